"""Compute slowed by communication running beside it, priced with the published GPU
numbers only (a measured CPU profile has its own overlap, Efficiency.comm_overlap; the
fitted constants have it inside their fit).

NCCL's kernels occupy SMs and HBM bandwidth while they run, so a GEMM or attention kernel
issued beside a collective runs slower than alone. The measured mean: compute kernels
overlapped with collectives run 18.9 % longer than alone (max 40.0 %), over GPT and LLaMA
layers on 4 A100s, H100s, MI250s and MI210s (Characterizing Compute-Communication Overlap
in GPU-Accelerated Distributed Deep Learning, arXiv:2507.03114, abstract; the data file's
`overlap_compute_slowdown`, s).

A collective's hidden seconds (its time less its exposed time: the part the planner puts
behind compute) are spent beside compute; that compute, slowed by 1 + s, does only
1 / (1 + s) of its work in them, so the step grows by

    hidden x s / (1 + s)

bounded by the compute there is to slow (the layers' compute and recompute). Counted for
every collective but the pipeline's sends, which the pipeline timeline places (hidden or
waited on by the schedule, not beside a known kernel).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from plait.plan.comm import price

Num = Any
TERM = "compute beside communication"
NOT_BESIDE = ("pp",)  # the pipeline's sends: placed by the pipeline timeline


def hidden_seconds(colls: list[price.Collective]) -> Num:
    """Seconds per step the collectives in `colls` run behind compute (each one's time
    less its exposed time), the pipeline's sends left out."""
    total = 0.0
    for c in colls:
        if c.dim not in NOT_BESIDE:
            total = total + np.maximum(c.total - c.exposed, 0.0)
    return total


def slowdown_seconds(colls: list[price.Collective], compute: Num, slowdown: float) -> Num:
    """Seconds a step grows by as its compute runs `slowdown` slower beside the hidden
    collectives (the module docstring); `compute` bounds the hidden seconds."""
    hidden = np.minimum(hidden_seconds(colls), compute)
    return hidden * slowdown / (1.0 + slowdown)
