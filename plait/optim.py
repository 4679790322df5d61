"""The optimizer's maths: AdamW, plain SGD and Muon (its maths in plait/muon.py) on fp32
masters, in place, no communication.

With precision "bf16" the model holds bf16 parameters and gradients (2 + 2 bytes a
parameter) and the optimizer holds an fp32 master copy, momentum and variance (4 + 4 + 4):
the 16 bytes per parameter of Rajbhandari et al. 2020 (ZeRO), section 3.1. With "fp32" the
parameter is its own master (4 + 4 + 8); with "fp64" too, in float64 (8 + 8 + 16).
The update follows torch.optim.AdamW's arithmetic exactly (Loshchilov & Hutter 2019), so the
fp32 single-process reference can use torch's optimizer as an independent oracle.

Its own layer, below `comm` and `parallel` (tests/test_layering.py): the replicated optimizer
and ZeRO (plait/parallel/) run the same update on whole tensors or on flat shards. The
learning-rate schedule of a training run is plait/train/lr_schedule.py's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.model.precision import wide_dtype, widened
from plait.muon import MuonSettings, is_muon_matrix, muon_update


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices only: not on norm gains (the usual Llama/GPT practice)."""
    return p.ndim >= 2


class MixedPrecisionAdamW:
    """AdamW, plain SGD or Muon over `named_params`; masters are fp32 (the parameter itself
    when it is fp32 or float64, which keeps its float64). SGD keeps no moments; Muon keeps
    one momentum buffer a matrix (plait/muon.py's rule) and AdamW's moments for the rest."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], betas: tuple[float, float],
                 eps: float, weight_decay: float, kind: str = "adamw",
                 muon: MuonSettings | None = None):
        self.params = [p for _, p in named_params]
        self.decay = [decays(n, p) for n, p in named_params]
        self.master = [p.data if p.dtype == wide_dtype(p.dtype) else widened(p.detach()).clone()
                       for p in self.params]
        self.kind, self.muon = kind, muon or MuonSettings()
        on_muon = [kind == "muon" and is_muon_matrix(n, p) for n, p in named_params]
        # indices of the parameters each rule updates; the states follow their order
        self.muon_ids = [i for i, m in enumerate(on_muon) if m]
        self.adam_ids = [i for i, m in enumerate(on_muon) if not m] if kind != "sgd" else []
        self.exp_avg = [torch.zeros_like(self.master[i]) for i in self.adam_ids]
        self.exp_avg_sq = [torch.zeros_like(self.master[i]) for i in self.adam_ids]
        self.momentum = [torch.zeros_like(self.master[i]) for i in self.muon_ids]
        # Muon's matrices held as slices (tensor parallel: plait/parallel/muon_tp.py), set
        # by the strategy that cut them; None: every matrix whole
        self.sliced = None
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.steps = 0
        self._saved: tuple[list[torch.Tensor], int] | None = None  # see `snapshot`

    def states(self, i: int) -> dict[str, torch.Tensor]:
        """The optimizer states of parameter i beside its master, by name."""
        if i in self.muon_ids:
            return {"momentum": self.momentum[self.muon_ids.index(i)]}
        if i in self.adam_ids:
            j = self.adam_ids.index(i)
            return {"exp_avg": self.exp_avg[j], "exp_avg_sq": self.exp_avg_sq[j]}
        return {}

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update with gradients p.grad * grad_scale (the clipping coefficient)."""
        self.steps += 1
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        if self.kind == "sgd":
            sgd_update([self.master[i] for i in live], [self.params[i].grad for i in live],
                       lr, grad_scale)
        adam = [(i, j) for j, i in enumerate(self.adam_ids) if self.params[i].grad is not None]
        if adam:
            adamw_update(
                masters=[self.master[i] for i, _ in adam],
                grads=[self.params[i].grad for i, _ in adam],
                exp_avgs=[self.exp_avg[j] for _, j in adam],
                exp_avg_sqs=[self.exp_avg_sq[j] for _, j in adam],
                decayed=[self.master[i] for i, _ in adam if self.decay[i]],
                step=self.steps, lr=lr, betas=self.betas, eps=self.eps,
                weight_decay=self.weight_decay, grad_scale=grad_scale)
        on_muon = [(i, j) for j, i in enumerate(self.muon_ids) if self.params[i].grad is not None]
        if on_muon:
            m = self.muon
            muon_update([self.master[i] for i, _ in on_muon],
                        [self.params[i].grad for i, _ in on_muon],
                        [self.momentum[j] for _, j in on_muon], lr, m.momentum,
                        self.weight_decay, m.scale, m.ns_dtype, grad_scale,
                        sliced=(self.sliced.select([i for i, _ in on_muon])
                                if self.sliced is not None else None))
        for i in live:
            if self.master[i] is not self.params[i].data:
                self.params[i].data.copy_(self.master[i])

    def snapshot(self) -> None:
        """Copy the masters, moments and update count, so that `restore` undoes the next
        updates exactly (a copy, not the update's inverse: bit for bit)."""
        self._saved = ([t.clone() for t in self._state_tensors()],
                       self.steps)

    @torch.no_grad()
    def restore(self) -> None:
        """Back to the `snapshot` (masters, moments, count; the model's parameters from the
        masters); the copy is dropped."""
        if self._saved is None:
            raise RuntimeError("restore() without a snapshot()")
        copies, self.steps = self._saved
        for t, c in zip(self._state_tensors(), copies, strict=True):
            t.copy_(c)
        for m, p in zip(self.master, self.params, strict=True):
            if m is not p.data:
                p.data.copy_(m)
        self._saved = None

    def drop_snapshot(self) -> None:
        self._saved = None

    def _state_tensors(self) -> list[torch.Tensor]:
        return self.master + self.exp_avg + self.exp_avg_sq + self.momentum

    def snapshot_tensors(self) -> list[torch.Tensor]:
        """The snapshot's copies while one is held (what the memory meter counts)."""
        return list(self._saved[0]) if self._saved is not None else []

    def state_bytes(self) -> dict[str, int]:
        """Bytes held by the optimizer: fp32 master (when separate), the two moments (and
        Muon's momentum buffers)."""
        master = sum(m.numel() * 4 for m, p in zip(self.master, self.params) if m is not p.data)
        moments = sum(t.numel() * t.element_size()
                      for t in self.exp_avg + self.exp_avg_sq + self.momentum)
        return {"master": master, "moments": moments}


@torch.no_grad()
def adamw_update(masters: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 decayed: list[torch.Tensor], step: int, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float,
                 grad_scale: float = 1.0) -> None:
    """AdamW on fp32 tensors in place, torch.optim.AdamW's arithmetic element for element.

    Multi-tensor (foreach) kernels: a few calls instead of a few per tensor, in chunks of
    about `CHUNK` elements so the temporaries (fp32 gradient copy, denominator) stay small.
    `decayed` are the masters (or views of them) that take weight decay.
    """
    if decayed and weight_decay:
        torch._foreach_mul_(decayed, 1 - lr * weight_decay)
    start, size = 0, 0
    for i, m in enumerate(masters):
        size += m.numel()
        if size >= CHUNK or i == len(masters) - 1:
            sl = slice(start, i + 1)
            # the widened gradients as an argument, not a name: one chunk's copies alive
            _adam_chunk(masters[sl],
                        [g.to(w.dtype) for g, w in zip(grads[sl], masters[sl], strict=True)],
                        exp_avgs[sl], exp_avg_sqs[sl], step, lr, betas, eps, grad_scale)
            start, size = i + 1, 0


@torch.no_grad()
def sgd_update(masters: list[torch.Tensor], grads: list[torch.Tensor], lr: float,
               grad_scale: float = 1.0) -> None:
    """Plain SGD on fp32 masters, torch.optim.SGD's arithmetic (no momentum, no decay):
    the gradient is clipped first (scaled), then master -= lr * gradient."""
    for start in range(0, len(masters), 64):  # bounded fp32 temporaries
        g = [x.to(w.dtype) for x, w in zip(grads[start:start + 64], masters[start:start + 64],
                                           strict=True)]
        if grad_scale != 1.0:
            g = torch._foreach_mul(g, grad_scale)
        torch._foreach_add_(masters[start:start + 64], g, alpha=-lr)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), at most 1."""
    if max_norm <= 0:
        return 1.0
    return min(max_norm / (total_norm + 1e-6), 1.0)


CHUNK = 1 << 16  # elements per foreach chunk: bounds the update's temporaries


def _adam_chunk(masters, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps, grad_scale):
    b1, b2 = betas
    bias1, bias2 = 1 - b1 ** step, 1 - b2 ** step
    if grad_scale != 1.0:
        grads = torch._foreach_mul(grads, grad_scale)  # not in place: grads stay as reduced
    torch._foreach_lerp_(exp_avgs, grads, 1 - b1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - b2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bias2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(masters, exp_avgs, denom, value=-lr / bias1)

