"""The planner: memory, communication and compute models of a layout; search; `plait plan`.

Entry points: `evaluate` (one layout), `search` (all layouts), `predict_memory` (a plait
Config, for the runtime-side test that compares the prediction with the ledger),
`rank_collectives` (one pipeline rank's collectives). The modules: docs/planner.md, "Code".
"""

from __future__ import annotations

from plait.plan.basis import Basis, Layout, Training
from plait.plan.comm.rank import rank_collectives
from plait.plan.estimate import Estimate, evaluate
from plait.plan.from_config import config_inputs, estimate_config, predict_memory
from plait.plan.hardware import Cluster
from plait.plan.search import search
from plait.plan.shape import Shape

__all__ = ["Basis", "Estimate", "Layout", "Training", "evaluate", "search", "predict_memory",
           "estimate_config", "config_inputs", "rank_collectives", "Shape",
           "Cluster"]
