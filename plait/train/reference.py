"""The parity oracle's reference: a plain single-process run with torch's own pieces.

Same model, seed, data order and global batch as any layout, but none of plait's parallel,
loss, schedule or optimizer code: the whole global batch in one forward/backward, the mean
cross-entropy by `F.cross_entropy(reduction="mean")`, the learning rate from its own
formula, its own weight-decay grouping, torch's AdamW or SGD (foreach off, so the
arithmetic matches element-wise) or its own Muon (`ReferenceMuon`: the matrices found by
module type, not by plait's name rule; Newton-Schulz written out a matrix at a time) and
torch's clip_grad_norm_. In float64 when the run's
precision is fp64 (the oracle's precision, docs/parity.md), else in fp32.

What it shares with plait is the model (`build_model`, checked on its own by
tests/test_model.py: causality, RoPE, norms, attention against naive formulas) and the
data order (`GlobalBatches`, tests/test_data.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from plait.config import Config
from plait.model.moe import Experts, MoE, Router
from plait.model.precision import widened
from plait.model.transformer import build_model
from plait.train.data import GlobalBatches


@dataclass
class Reference:
    """What a layout is compared with: per step, and at the end."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)  # before clipping
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # step 0, unclipped
    # MoE models, per step: balance loss, the worst layer's max / mean load, dropped
    # assignments, the biases by name after the step
    moe: list[dict] = field(default_factory=list)
    lr: float = 0.0  # the peak learning rate: the scale of a parameter's error after Adam
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)  # Muon's, by name


def reference_lr(step: int, cfg: Config) -> float:
    """Linear warm-up to lr over warmup_steps (step 0 at lr/warmup), then a half cosine to
    lr * min_lr_ratio at the last step (Loshchilov & Hutter 2017, SGDR, eq. 5)."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(t.steps - t.warmup_steps, 1)
    frac = min((step - t.warmup_steps) / decay_steps, 1.0)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * (1 + math.cos(math.pi * frac)) / 2


def _optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=t.lr, foreach=False)
    on_muon = {id(p) for p in _muon_matrices(model)} if t.optimizer == "muon" else set()
    rest = [p for p in model.parameters() if id(p) not in on_muon]
    # decay on weight matrices only, never on norm gains (the 1-D parameters)
    matrices = [p for p in rest if p.dim() > 1]
    gains = [p for p in rest if p.dim() <= 1]
    adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": t.weight_decay},
                               {"params": gains, "weight_decay": 0.0}],
                              lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    if t.optimizer != "muon":
        return adamw
    return ReferenceMuon([p for p in model.parameters() if id(p) in on_muon], adamw, cfg)


def _muon_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Muon's matrices found by module, not by name: every Linear's weight and the expert
    stacks inside the blocks, less the MoE routers' (the embedding, the head and the norms
    are outside the blocks or not Linear)."""
    routers = {id(p) for m in model.modules() if isinstance(m, Router) for p in m.parameters()}
    found = []
    for block in model.layers:
        for m in block.modules():
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in routers:
                found.append(m.weight)
            elif isinstance(m, Experts):
                found.extend(m.parameters(recurse=False))
    return found


def newton_schulz5(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Five steps of X <- 3.4445 X - 4.7750 (X X^T) X + 2.0315 (X X^T)^2 X from
    X = G / ||G||_F, in `dtype`, one matrix at a time (Jordan et al. 2024)."""
    x = g.to(dtype)
    x = x / (torch.sqrt((x * x).sum()) + 1e-7)
    for _ in range(5):
        xxt = x @ x.T
        x = 3.4445 * x - 4.7750 * (xxt @ x) + 2.0315 * (xxt @ (xxt @ x))
    return x.to(g.dtype)


class ReferenceMuon:
    """Muon as Moonlight states it, one matrix (one expert's) at a time, in a loop of its
    own; the other parameters go to torch's AdamW (`adamw`). Looks like an optimizer to
    the reference loop: param_groups (the learning rate), step, zero_grad."""

    def __init__(self, matrices: list[torch.nn.Parameter], adamw: torch.optim.Optimizer,
                 cfg: Config):
        t = cfg.train
        self.matrices, self.adamw, self.train = matrices, adamw, t
        self.lr = t.lr
        self.buffers = [torch.zeros_like(p) for p in matrices]
        self.param_groups = [*adamw.param_groups, self]  # the loop sets each group's lr
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32,
                      "fp64": torch.float64}[t.muon_ns_dtype]

    def __setitem__(self, key: str, value: float) -> None:
        self.lr = value

    def _factor(self, rows: int, cols: int) -> float:
        if self.train.muon_scale == "moonlight":
            return 0.2 * max(rows, cols) ** 0.5
        return max(1.0, rows / cols) ** 0.5

    @torch.no_grad()
    def step(self) -> None:
        self.adamw.step()
        t, mu = self.train, self.train.muon_momentum
        for p, buf in zip(self.matrices, self.buffers, strict=True):
            if p.grad is None:
                continue
            buf.copy_(mu * buf + p.grad)
            ahead = p.grad + mu * buf
            mats = [(p, ahead)] if p.dim() == 2 else list(zip(p, ahead, strict=True))
            for w, g in mats:
                update = newton_schulz5(g, self.dtype)
                w.copy_(w * (1 - self.lr * t.weight_decay)
                        - self.lr * self._factor(*w.shape) * update)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        for p in self.matrices:
            p.grad = None


def _moe_step(by_name: dict[str, MoE], update: bool) -> dict:
    """The step's routing statistics and the auxiliary-loss-free bias update, written from
    DeepSeek-V3 section 2.1.2 (b_i += gamma * sign(mean load - load_i)), not plait's."""
    moes = list(by_name.values())
    out = {"aux_loss": sum(m.aux_sum for m in moes),
           "load_max_over_mean": max(float(m.load.max() / m.load.mean()) for m in moes),
           "dropped_tokens": sum(m.dropped for m in moes)}
    for m in moes:
        if update and m.bias_rate > 0:
            with torch.no_grad():
                m.bias += m.bias_rate * torch.sign(m.load.mean() - m.load).float()
        m.reset_stats()
    out["bias"] = {f"{n}.bias": m.bias.clone() for n, m in by_name.items()}
    return out


def documents_loss(model: torch.nn.Module, tokens: torch.Tensor, eot: int) -> torch.Tensor:
    """Packed documents, the plain way: each document of each row (up to and including its
    end-of-document token `eot`) run through the model as a sequence of its own, at
    positions 0.., with plain causal attention; the mean cross-entropy over the targets
    of every document's tokens but its end-of-document token's (the next document's)."""
    total, count = None, 0
    for row in tokens:
        x, y = row[:-1], row[1:]
        ends = [int(e) + 1 for e in (x == eot).nonzero().flatten()]
        for a, b in zip([0, *ends], [*ends, len(x)], strict=True):
            if a == b:
                continue
            logits = widened(model(x[a:b].unsqueeze(0))[0])
            keep = x[a:b] != eot
            part = F.cross_entropy(logits[keep], y[a:b][keep], reduction="sum")
            total = part if total is None else total + part
            count += int(keep.sum())
    return total / count


def reference_run(cfg: Config, batches: GlobalBatches) -> Reference:
    """Loss, grad norm per step, first-step gradients and final parameters, single process."""
    t = cfg.train
    dtype = torch.float64 if t.precision == "fp64" else torch.float32
    model = build_model(cfg.model, seed=t.seed, dtype=dtype)
    optim = _optimizer(cfg, model)
    ref = Reference(lr=t.lr)
    moes = {n: m for n, m in model.named_modules() if isinstance(m, MoE)}
    if moes and t.documents:  # routing is per token, but the balance loss is per forward
        raise ValueError("the reference runs packed documents for dense models only")
    for m in moes.values():  # the balance loss, a mean over the batch's tokens like the CE
        m.aux_loss_scale = 1.0 / (t.global_batch * t.seq_len)
    for step in range(t.steps):
        tokens = batches.rows(step)
        if t.documents:
            loss = documents_loss(model, tokens, batches.end_of_document())
        else:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(widened(logits).reshape(-1, logits.shape[-1]),
                                   tokens[:, 1:].reshape(-1), reduction="mean")
        loss.backward()
        if step == 0:
            ref.first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        # the norm clip_grad_norm_ returns is the one before clipping
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
        ref.grad_norms.append(float(norm))
        for group in optim.param_groups:
            group["lr"] = reference_lr(step, cfg)
        optim.step()
        optim.zero_grad(set_to_none=True)
        ref.losses.append(float(loss.detach()))
        if moes:
            ref.moe.append(_moe_step(moes, update=math.isfinite(float(norm))))
    ref.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if t.optimizer == "muon":  # the reference's own Muon: its buffers by name
        name_of = {id(p): n for n, p in model.named_parameters()}
        ref.momentum = {name_of[id(p)]: b.clone()
                        for p, b in zip(optim.matrices, optim.buffers, strict=True)}
    return ref
