"""The training run's learning-rate schedule: linear warm-up, then cosine decay. The update
maths (AdamW, SGD, fp32 masters) and the grad-norm clip coefficient are plait/optim.py's.
"""

from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to base_lr * min_ratio."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
