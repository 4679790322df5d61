"""The training run's side of the optimizer: the learning-rate schedule and grad-norm
clipping. The update maths (AdamW, SGD, fp32 masters) is plait/optim.py, re-exported here
for callers that import it from the training layer.
"""

from __future__ import annotations

import math

from plait.optim import CHUNK, MixedPrecisionAdamW, adamw_update, decays, sgd_update

__all__ = ["CHUNK", "MixedPrecisionAdamW", "adamw_update", "clip_coefficient", "decays",
           "lr_at", "sgd_update"]


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to base_lr * min_ratio."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), at most 1."""
    if max_norm <= 0:
        return 1.0
    return min(max_norm / (total_norm + 1e-6), 1.0)
