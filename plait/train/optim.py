"""The training run's side of the optimizer: the learning-rate schedule and grad-norm
clipping. The update maths (AdamW, SGD, fp32 masters) and the clip coefficient are in
plait/optim.py, re-exported here for callers that import them from the training layer.
"""

from __future__ import annotations

import math

from plait.optim import (
    CHUNK,
    MixedPrecisionAdamW,
    adamw_update,
    clip_coefficient,
    decays,
    sgd_update,
)

__all__ = ["CHUNK", "MixedPrecisionAdamW", "adamw_update", "clip_coefficient", "decays",
           "lr_at", "sgd_update"]


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to base_lr * min_ratio."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
