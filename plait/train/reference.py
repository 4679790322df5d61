"""The parity oracle's reference: a plain single-process run with torch's own pieces.

Same model, seed, data order and global batch as any layout, but nothing of plait's
parallel or optimizer code: the whole global batch in one forward/backward, torch's AdamW
(foreach off, so its arithmetic matches element-wise), torch's clip_grad_norm_. fp32 only.
"""

from __future__ import annotations

import torch

from plait.config import Config
from plait.model.transformer import build_model
from plait.train.data import GlobalBatches
from plait.train.optim import decays, lr_at
from plait.train.step import microbatch_loss


def reference_run(cfg: Config, batches: GlobalBatches
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(loss per step, final parameters by name) of the single-process fp32 run."""
    t = cfg.train
    model = build_model(cfg.model, seed=t.seed)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": t.weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                              foreach=False)
    losses = []
    for step in range(t.steps):
        tokens = batches.rows(step)
        loss = microbatch_loss(model, tokens, tokens[:, 1:].numel())
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=False)
        for g in optim.param_groups:
            g["lr"] = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in named}
