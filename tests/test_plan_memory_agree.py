"""The planner's two memory models agree where they describe the same bytes.

plait/plan/memory.py (closed form, vectorised: the search's, kernels="fused") and
plait/plan/runtime_memory.py (plait's eager runtime, moment by moment: kernels="eager")
differ in activations and transients by design (fused GPU kernels against eager CPU
code). The model states do not: at the step's end (the grad norm, before the optimizer's
temporaries) the runtime model's parameters, gradients and optimizer states on the closed
form's most loaded pipeline rank are the closed form's, to the byte, for data parallel
with every ZeRO stage, tensor parallel with and without SP, pipelines, both precisions,
both optimizers, post-validation's copy of the optimizer states and hybrid sharding.
ZeRO-2/3 under pp (whole gradients through the step) and ZeRO-3 gathering once a step
(whole parameters through it) hold more during the step than at its end: both models say
so, and at the step's end the runtime model holds their shards.
"""

from __future__ import annotations

import pytest
from helpers import config

from plait.plan import estimate_config, predict_memory
from plait.plan.host_memory import model_state_bytes
from plait.plan.runtime_memory import rank_moments

STATES = ("parameters", "gradients", "optimizer states")
LAYOUTS = [
    [],
    ["parallel.dp=2"],
    ["parallel.dp=2", "parallel.zero=1"],
    ["parallel.dp=2", "parallel.zero=2"],
    ["parallel.dp=4", "parallel.zero=3"],
    ["parallel.tp=2"],
    ["parallel.tp=2", "parallel.sp=true", "parallel.dp=2", "parallel.zero=1"],
    ["parallel.dp=2", "train.precision=bf16"],
    ["parallel.dp=2", "parallel.zero=3", "train.precision=bf16"],
    ["parallel.dp=2", "train.optimizer=sgd", "train.weight_decay=0"],
    ["parallel.pp=2", "parallel.microbatches=2"],
    ["parallel.pp=2", "parallel.dp=2", "parallel.tp=2", "parallel.microbatches=2"],
    ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2",
     "parallel.optimizer_sync=post_validation"],
    # hybrid sharding: the states sharded over a shard group of 2, not dp = 4
    *[["parallel.dp_shard=2", "parallel.dp_replicate=2", f"parallel.zero={z}"]
      for z in (1, 2, 3)],
    ["parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.zero=3", "parallel.tp=2",
     "parallel.sp=true", "train.precision=bf16"],
    ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2", "parallel.microbatches=2"],
    ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "parallel.microbatches=2",
     "parallel.zero3_gather=step", "train.precision=bf16"],
    ["parallel.dp=4", "parallel.zero=3", "parallel.zero3_gather=step"],
]


def _at_step_end(cfg, states: dict) -> dict:
    """The model states once the step's gradients are reduce-scattered and its gathered
    units freed: ZeRO-2/3's gradient shards under pp, ZeRO-3's parameter shards."""
    p, out = cfg.parallel, dict(states)
    if p.zero >= 2 and p.pp > 1:
        out["gradients"] = states["gradients"] / p.dp
    if p.zero == 3 and p.zero3_gather == "step":
        out["parameters"] = states["parameters"] / (p.dp + 1)  # the shard of shard + whole
    return out


def _peak_pp_rank(cfg) -> int:
    """The pipeline rank the closed form describes (its most loaded: first or last)."""
    return 0 if str(estimate_config(cfg).peak_rank) == "first" else cfg.parallel.pp - 1


@pytest.mark.parametrize("sets", LAYOUTS, ids=lambda s: ",".join(s) or "one rank")
def test_model_states_agree(sets):
    cfg = config("train.precision=fp32", *sets)  # bf16 layouts say so later, and win
    cfg = cfg.check(cfg.parallel.world_size)
    fused = predict_memory(cfg)
    rank = _peak_pp_rank(cfg)
    # the runtime model's sizes of that pipeline rank (its first tp, dp rank: global rank
    # pp_rank x the ranks inside a stage, in the default mesh order)
    inner = cfg.parallel.world_size // cfg.parallel.pp
    sizes = model_state_bytes(cfg, rank * inner)
    assert {k: sizes[k] for k in STATES} == {k: fused[k] for k in STATES}
    if cfg.parallel.optimizer_sync == "barrier":  # the copy is made just before the update
        (moment,) = [m for m in rank_moments(cfg, rank) if m.name == "grad norm"]
        want = _at_step_end(cfg, {k: fused[k] for k in STATES})
        assert {k: moment.bytes[k] for k in STATES} == pytest.approx(want, rel=1e-12)
