"""Muon's maths: which parameters it updates, the Newton-Schulz iteration, the update.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"):
Nesterov momentum on each weight matrix, then the momentum's orthogonalisation by five
Newton-Schulz iterations of the quintic X <- a X + (b A + c A^2) X, A = X X^T, with
(a, b, c) = (3.4445, -4.7750, 2.0315), after scaling X to Frobenius norm 1 (so every
singular value starts in (0, 1]). Moonlight (Liu et al. 2025, arXiv 2502.16982) adds
decoupled weight decay and scales the update by 0.2 * sqrt(max(A, B)) so that its RMS is
AdamW's: AdamW's learning rate and decay carry over. The parameters that are not hidden
matrices (embeddings, the output head, norms, biases, the router) stay on AdamW.

In the optim layer beside plait/optim.py: torch only, no communication. Whole matrices
only: a sharded layout gathers each matrix before calling `orthogonalise`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Protocol

import torch

from plait.config.muon_checks import MUON_SCALES

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
# the iteration's dtype: bf16 as published; fp32 / fp64 where a parity check wants the
# layouts' roundings alone
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
SCALES = MUON_SCALES
# the leaf names that are never Muon matrices although 2-D: the token embedding, the
# output head (Muon's authors keep both on AdamW) and the MoE router (a classifier)
ADAMW_MATRICES = ("embed", "head", "router")
MUON_RULE = ("Muon updates every weight of 2 or more dimensions (an expert stack: each "
             "expert's matrix on its own) except the token embedding, the output head and "
             "the MoE router; those, the norms and the biases take AdamW")


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """The rule (MUON_RULE): a hidden matrix, by its rank and its model name."""
    return p.ndim >= 2 and not any(part in ADAMW_MATRICES for part in name.split("."))


def muon_states(name: str, p: torch.Tensor) -> tuple[str, ...]:
    """The optimizer states a parameter keeps under --optimizer muon (checkpoints save
    these): a Muon matrix its momentum, the others AdamW's two moments."""
    return ("master", "momentum") if is_muon_matrix(name, p) else (
        "master", "exp_avg", "exp_avg_sq")


def update_scale(shape: tuple[int, ...] | torch.Size, form: str) -> float:
    """The factor on the orthogonalised update of an A x B matrix (the last two axes):
    Moonlight's 0.2 * sqrt(max(A, B)), or the original sqrt(max(1, A / B))."""
    rows, cols = shape[-2], shape[-1]
    if form == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if form == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"Muon scale {form!r}; use one of {SCALES}")


def orthogonalise(g: torch.Tensor, dtype: torch.dtype, steps: int = NS_STEPS
                  ) -> torch.Tensor:
    """The Newton-Schulz iteration on each matrix of `g` (the last two axes; a leading
    axis: a stack of matrices, each on its own), computed in `dtype`, returned in g's."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the wide form: A = X X^T is the smaller square
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(g.dtype)


@torch.no_grad()
def muon_update(masters: list[torch.Tensor], grads: list[torch.Tensor],
                momenta: list[torch.Tensor], lr: float, momentum: float,
                weight_decay: float, scale: str, ns_dtype: torch.dtype,
                grad_scale: float = 1.0, sliced: SlicedMatrices | None = None) -> None:
    """Muon in place: buf = momentum * buf + g; the Nesterov look-ahead g + momentum * buf
    orthogonalised; master *= 1 - lr * weight_decay; master -= lr * update_scale * the
    orthogonalised look-ahead. `sliced`: the masters are slices of matrices cut over
    ranks (tensor parallel), orthogonalised whole by `sliced` (a collective), scaled by
    their whole shapes; None: whole matrices."""
    looks = []
    for master, grad, buf in zip(masters, grads, momenta, strict=True):
        g = grad.to(master.dtype)
        if grad_scale != 1.0:
            g = g * grad_scale
        buf.mul_(momentum).add_(g)
        looks.append(g.add(buf, alpha=momentum))
    if sliced is None:
        directions = [orthogonalise(x, ns_dtype) for x in looks]
        shapes = [m.shape for m in masters]
    else:
        directions, shapes = sliced.orthogonalise(looks, ns_dtype), sliced.shapes
    for master, direction, shape in zip(masters, directions, shapes, strict=True):
        if weight_decay:
            master.mul_(1 - lr * weight_decay)
        master.add_(direction, alpha=-lr * update_scale(shape, scale))


class SlicedMatrices(Protocol):
    """Muon's matrices held as slices (plait/parallel/muon_tp.py): orthogonalised whole."""

    shapes: list[tuple[int, ...]]  # each matrix's whole shape

    def orthogonalise(self, looks: list[torch.Tensor], dtype: torch.dtype
                      ) -> list[torch.Tensor]:
        """Each slice's part of its whole matrix's orthogonalisation (collective)."""


class MuonSettings:
    """What Muon takes beside AdamW's settings (train.muon_*)."""

    def __init__(self, momentum: float = 0.95, scale: str = "moonlight", ns_dtype: str = "bf16"):
        self.momentum, self.scale, self.ns_dtype = momentum, scale, NS_DTYPES[ns_dtype]


def muon_settings(train) -> MuonSettings:
    """Muon's settings from a TrainConfig (train.muon_momentum, muon_scale, muon_ns_dtype)."""
    return MuonSettings(train.muon_momentum, train.muon_scale, train.muon_ns_dtype)


def muon_split(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str]]:
    """(the names Muon updates, the names AdamW updates), by the rule."""
    named = list(named)
    return ([n for n, p in named if is_muon_matrix(n, p)],
            [n for n, p in named if not is_muon_matrix(n, p)])


def muon_summary(named: Iterable[tuple[str, torch.Tensor]], train) -> str:
    """The run summary's optimizer line: how many tensors and parameters each rule takes,
    and which weights of 2 or more dimensions stay on AdamW (a layer's name once)."""
    named = list(named)
    on_muon, on_adamw = muon_split(named)
    sizes = {n: p.numel() for n, p in named}
    kept = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n, p in named
                         if n in on_adamw and p.ndim >= 2)
    return (f"muon ({train.muon_scale} scale, Newton-Schulz in {train.muon_ns_dtype}): "
            f"{len(on_muon)} matrices, {sum(sizes[n] for n in on_muon):,} parameters; AdamW: "
            f"{len(on_adamw)} tensors, {sum(sizes[n] for n in on_adamw):,} parameters (the "
            f"norms, the biases, {', '.join(kept) or 'no matrix'})")
