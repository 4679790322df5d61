"""Tensor parallel (Megatron style) and sequence parallel, applied to the plain model.

Tensor parallel splits the width of each matrix multiply over the `tp` ranks (Shoeybi et
al. 2019). In a block, the first weights (wq, wk, wv; w1, w3) are *column* parallel: each
rank holds a slice of their output rows, so attention heads and FFN columns are split; the
second weights (wo; w2) are *row* parallel: each rank holds the matching slice of their
input columns and produces a partial sum. A block's sub-layer is one region:

    x --copy_to_tp--> [wq wk wv -> attention on my heads -> wo] --reduce_from_tp--> + x

so a layer moves 2 all-reduces of b·s·h forward (leaving each region) and 2 backward
(entering them). Sequence parallel (Korthikanti et al. 2022) also splits the rest of the
block (norms, residual stream) along the sequence: regions are entered by all-gather and
left by reduce-scatter (the same bytes: all-reduce = reduce-scatter + all-gather), and
norm/residual activations shrink by t.

The plan maps module paths (`*` is one path component) to styles; applying it swaps
modules and adds hooks from outside, so the model code stays free of parallel code:

    colwise      split the weight's output rows           ColumnParallelLinear
    colwise_kv   as colwise when tp divides the KV heads; otherwise each KV head is held
                 whole by the tp/n_kv ranks whose query heads use it (its gradient is
                 summed over those ranks)
    rowwise      split the weight's input columns         RowParallelLinear
    region       enter: copy_to_tp | all_gather_from_sp; leave: reduce_from_tp |
                 reduce_scatter_to_sp (forward hooks on the module)
    sequence     a replicated weight whose gradient on each rank is a part (under SP: of my
                 sequence chunk; MLA's down-projections: of my heads): all-reduced over tp
    vocab_embed  VocabParallelEmbedding (vocabulary rows split, padded to a multiple of tp)
    vocab_head   ColumnParallelLinear over the vocabulary; the loss is vocab-parallel

Parameters are initialised full from their name-seeded init, then sliced, so each rank's
shard is exactly the reference's slice (the parity oracle relies on it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from plait.comm import ops
from plait.comm.autograd import (
    all_gather_from_sp,
    copy_to_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from plait.mesh import ParallelMesh
from plait.model.precision import widened
from plait.model.presets import ModelConfig
from plait.parallel import async_tp as async_tp_mod
from plait.placement import PlacementTable, Split

DIM = "tp"


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (the padding rows are never used)."""
    return -(-vocab_size // tp) * tp


def _shard(full: torch.Tensor, axis: int, mesh: ParallelMesh, placements: PlacementTable,
           replicas: int = 1, padded: int | None = None) -> nn.Parameter:
    """This rank's slice of `full` as a Parameter, recorded in `placements`."""
    t, r = mesh.size(DIM), mesh.coord(DIM)
    length = full.shape[axis]
    size = max(padded or 0, length) // (t // replicas)
    start = (r // replicas) * size
    # this rank's rows of the zero-padded tensor, without forming the padded whole (a dry
    # run's unwritten full stage stays untouched: plait/model/transformer.py `materialise`)
    kept = max(0, min(size, length - start))
    part = full.detach().narrow(axis, min(start, length), kept)
    if kept < size:
        pad = list(full.shape)
        pad[axis] = size - kept
        part = torch.cat([part, full.new_zeros(pad)], axis)
    p = nn.Parameter(part if kept < size else part.clone())
    # a replicated slice (replicas > 1) counts in the grad norm on its first holder only
    placements.mark_split(p, full, Split(DIM, axis, full.shape[axis], replicas), mesh)
    return p


class ColumnParallelLinear(nn.Module):
    """y_local = x · W_localᵀ with W split along its output rows; x is whole on every rank.

    `enter` (optional) is the region function applied to x first (the LM head uses it; in
    blocks the region is entered once for wq/wk/wv together, by the sub-layer's hook).
    """

    def __init__(self, linear: nn.Linear, mesh: ParallelMesh, placements: PlacementTable,
                 replicas: int = 1, padded_out: int | None = None,
                 enter: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("plait's model has no biases; a biased linear needs its bias split")
        self.weight = _shard(linear.weight, 0, mesh, placements, replicas, padded_out)
        self.enter = enter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter is not None:
            x = self.enter(x)
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y_partial = x_local · W_localᵀ with W split along its input columns; the partial sums
    are reduced when the region is left (by the sub-layer's hook)."""

    def __init__(self, linear: nn.Linear, mesh: ParallelMesh, placements: PlacementTable):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("plait's model has no biases; a biased row linear adds it once")
        self.weight = _shard(linear.weight, 1, mesh, placements)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V_pad/t) of the table on each rank; a token outside them looks up
    zeros, and the partial embeddings are summed over tp (or reduce-scattered under SP)."""

    def __init__(self, emb: nn.Embedding, mesh: ParallelMesh, placements: PlacementTable,
                 sp: bool):
        super().__init__()
        t = mesh.size(DIM)
        self.vocab_size, self.padded = emb.num_embeddings, padded_vocab(emb.num_embeddings, t)
        self.per_rank = self.padded // t
        self.start = mesh.coord(DIM) * self.per_rank
        self.weight = _shard(emb.weight, 0, mesh, placements, padded=self.padded)
        self.mesh, self.sp = mesh, sp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sp:
            return reduce_scatter_to_sp(out, self.mesh, DIM, tag="tp.embed")
        return reduce_from_tp(out, self.mesh, DIM, tag="tp.embed")


# ---- vocab-parallel cross-entropy -------------------------------------------------------

class _VocabParallelCE(Function):
    """Per-token CE from logits split over the vocabulary; never forms (N, V) on a rank.

    loss_i = log Σ_v exp(z_iv − m_i) + m_i − z_i,y_i with m_i = max_v z_iv: each term is a
    max or a sum over v, so each rank reduces its columns and one all-reduce (max) plus one
    (sum of exp-sum and target logit, stacked) completes them. Backward: softmax − onehot,
    from the softmax kept in place of the local logits.
    """

    @staticmethod
    def forward(ctx, logits, targets, mesh, start, valid):
        z = widened(logits)
        n_local = z.shape[-1]
        if valid < n_local:  # padding columns of the vocabulary never win or count
            z = z.clone()
            z[:, valid:] = float("-inf")
        m = z.max(-1).values
        ops.all_reduce(m, mesh, DIM, op="max", tag="tp.loss")
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < valid)
        local_t = local_t.clamp(0, n_local - 1)
        e = z - m.unsqueeze(-1)  # a new (N, V/t) buffer, reused as exp and then softmax
        target_logit = e.gather(1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([target_logit, e.exp_().sum(-1)])
        ops.all_reduce(sums, mesh, DIM, tag="tp.loss")
        target_logit, sumexp = sums[0], sums[1]
        e.div_(sumexp.unsqueeze(-1))
        ctx.save_for_backward(e, local_t, mine)
        ctx.in_dtype = logits.dtype
        return sumexp.log() - target_logit

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, mine = ctx.saved_tensors
        grad = softmax  # saved only for this one backward: modify in place
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= mine.to(grad.dtype)
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 mesh: ParallelMesh, start: int, valid: int) -> torch.Tensor:
    """Per-token CE; logits (N, V_pad/t) hold vocabulary ids [start, start + valid) first."""
    return _VocabParallelCE.apply(logits, targets, mesh, start, valid)


@dataclass
class VocabParallelLoss:
    """The loss for a vocab-parallel head: summed CE over tokens, equal on every tp rank."""
    mesh: ParallelMesh
    start: int
    valid: int

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat, t = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        ce = vocab_parallel_cross_entropy(flat, t, self.mesh, self.start, self.valid)
        return ce.masked_fill(t < 0, 0.0).sum()  # a negative target is ignored (packed.py)


# ---- the plan ---------------------------------------------------------------------------

def default_plan(cfg: ModelConfig, sp: bool) -> dict[str, str]:
    """Module path -> style for plait's transformer."""
    plan = {
        "embed": "vocab_embed",
        "layers.*.attn": "region",
        "layers.*.attn.wq": "colwise",
        "layers.*.attn.wk": "colwise_kv",
        "layers.*.attn.wv": "colwise_kv",
        "layers.*.attn.wo": "rowwise",
        "layers.*.mlp": "region",
        "layers.*.mlp.w1": "colwise",
        "layers.*.mlp.w3": "colwise",
        "layers.*.mlp.w2": "rowwise",
        "head": "vocab_head",
    }
    if cfg.mla:
        for key in ("layers.*.attn.wq", "layers.*.attn.wk", "layers.*.attn.wv"):
            del plan[key]
        plan.update(mla_plan(cfg))
    if sp:
        plan.update({"layers.*.attn_norm": "sequence", "layers.*.mlp_norm": "sequence",
                     "norm": "sequence"})
    if cfg.n_experts:  # MoE blocks are replicated over tp (plait/parallel/expert.py)
        for key in ("layers.*.mlp", "layers.*.mlp.w1", "layers.*.mlp.w3", "layers.*.mlp.w2"):
            style = plan.pop(key)
            for i in range(cfg.n_dense_layers):
                plan[key.replace("*", str(i))] = style
        if sp:  # each tp rank routes its own sequence chunk: gradients summed over tp
            plan.update({f"layers.{i}.mlp": "sequence"
                         for i in range(cfg.n_dense_layers, cfg.n_layers)})
    return plan


def mla_plan(cfg: ModelConfig) -> dict[str, str]:
    """Multi-head latent attention (plait/model/mla.py) over tp, as Megatron-Core splits
    it: the up-projections wq_b (or wq) and wkv_b column-parallel (each rank its heads'
    rows), wo row-parallel; the down-projections wq_a, wkv_a and the latents' norms are
    small and replicated: every rank computes the latents whole, and since each rank's
    heads use only their share of a latent, their gradients are summed over tp (the
    `sequence` style's all-reduce, with or without SP)."""
    plan = {f"layers.*.attn.{n}": "colwise" for n in ("wkv_b", "wq_b" if cfg.q_lora_rank
                                                           else "wq")}
    replicated = ("wkv_a", "kv_norm") + (("wq_a", "q_norm") if cfg.q_lora_rank else ())
    plan.update({f"layers.*.attn.{n}": "sequence" for n in replicated})
    return plan


def kv_replicas(n_kv_heads: int, tp: int) -> int:
    """Ranks holding each KV head: 1 when tp divides the KV heads, else tp / n_kv_heads."""
    if n_kv_heads % tp == 0:
        return 1
    if tp % n_kv_heads:
        raise ValueError(f"tp={tp} and n_kv_heads={n_kv_heads}: one must divide the other")
    return tp // n_kv_heads


def _matches(pattern: str, name: str) -> bool:
    regex = r"\.".join("[^.]+" if part == "*" else re.escape(part)
                       for part in pattern.split("."))
    return re.fullmatch(regex, name) is not None


@dataclass
class TensorParallel:
    """What applying a plan produced: the loss to use and the hooks it installed."""
    mesh: ParallelMesh
    sp: bool
    plan: dict[str, str]
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    handles: list = field(default_factory=list)
    placements: PlacementTable = field(default_factory=PlacementTable)  # the tp splits


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _grad_all_reduce_hook(mesh: ParallelMesh, tag: str):
    def hook(g: torch.Tensor) -> torch.Tensor:
        out = g.contiguous().clone()
        ops.all_reduce(out, mesh, DIM, tag=tag)
        return out
    return hook


def _replicated_slice_hook(mesh: ParallelMesh, replicas: int, tag: str):
    """Sum a replicated slice's gradient over the ranks that hold it, with one tp
    all-reduce: each rank writes its partial into its slice's slot of a zero buffer."""
    t, r = mesh.size(DIM), mesh.coord(DIM)

    def hook(g: torch.Tensor) -> torch.Tensor:
        buf = g.new_zeros((t // replicas, *g.shape))
        buf[r // replicas] = g
        ops.all_reduce(buf, mesh, DIM, tag=tag)
        return buf[r // replicas].clone()
    return hook


def apply_tensor_parallel(model: nn.Module, mesh: ParallelMesh, sp: bool = False,
                          plan: dict[str, str] | None = None, partial: bool = False,
                          placements: PlacementTable | None = None,
                          async_tp: bool = False) -> TensorParallel:
    """Swap modules and add region hooks in place, following `plan` (default_plan).

    `partial`: `model` is a pipeline stage holding a slice of the model, so plan entries for
    modules it does not hold (the embedding off the first stage, the head off the last) are
    skipped instead of refused. Under SP a module declaring `seq_shards` (a pipeline stage)
    learns that its boundary hidden states are split t ways along the sequence.
    `async_tp` (with `sp`): regions and the LM head in their ring forms
    (plait/parallel/async_tp.py).
    """
    cfg: ModelConfig = model.cfg
    plan = default_plan(cfg, sp) if plan is None else plan
    if async_tp and not sp:
        raise ValueError("async tensor parallel decomposes sequence parallel's all-gather "
                         "and reduce-scatter; set sp=True")
    t = mesh.size(DIM)
    tp = TensorParallel(mesh, sp, plan, placements=placements or PlacementTable())
    names = [n for n, _ in model.named_modules() if n]
    # leaves first: swapping a module's children must happen before hooks see it
    for pattern, style in sorted(plan.items(), key=lambda kv: -kv[0].count(".")):
        hits = [n for n in names if _matches(pattern, n)]
        if not hits and partial:
            continue
        if not hits:
            raise ValueError(f"tensor-parallel plan: {pattern!r} matches no module")
        for name in hits:
            mod = model.get_submodule(name)
            if style == "colwise":
                _set_module(model, name, ColumnParallelLinear(mod, mesh, tp.placements))
            elif style == "colwise_kv":
                reps = kv_replicas(cfg.n_kv_heads, t)
                new = ColumnParallelLinear(mod, mesh, tp.placements, replicas=reps)
                if reps > 1:
                    tp.handles.append(new.weight.register_hook(
                        _replicated_slice_hook(mesh, reps, f"tp.{name}.grad")))
                _set_module(model, name, new)
            elif style == "rowwise":
                _set_module(model, name, RowParallelLinear(mod, mesh, tp.placements))
            elif style == "vocab_embed":
                _set_module(model, name, VocabParallelEmbedding(mod, mesh, tp.placements, sp))
            elif style == "vocab_head":
                tag = f"tp.{name}"
                if sp:
                    def enter(x, tag=tag):
                        return all_gather_from_sp(x, mesh, DIM, tag=tag)
                else:
                    def enter(x, tag=tag):
                        return copy_to_tp(x, mesh, DIM, tag=tag)
                vp = padded_vocab(mod.out_features, t)
                head = ColumnParallelLinear(mod, mesh, tp.placements, padded_out=vp, enter=enter)
                if cfg.tie_embeddings and isinstance(getattr(model, "embed", None),
                                                     VocabParallelEmbedding):
                    head.weight = model.embed.weight
                if async_tp:
                    head = async_tp_mod.GatheredHead(head.weight, mesh, tag)
                _set_module(model, name, head)
                start = mesh.coord(DIM) * (vp // t)
                tp.loss_sum = VocabParallelLoss(mesh, start,
                                                max(0, min(vp // t, mod.out_features - start)))
            elif style == "region" and async_tp:
                tp.handles += async_tp_mod.install_async_region(
                    mod, mesh, f"tp.{name}", ColumnParallelLinear, RowParallelLinear)
            elif style == "region":
                tp.handles += _install_region(mod, mesh, sp, f"tp.{name}")
            elif style == "sequence":
                for pname, p in mod.named_parameters():
                    tp.handles.append(p.register_hook(
                        _grad_all_reduce_hook(mesh, f"sp.{name}.{pname}.grad")))
            else:
                raise ValueError(f"tensor-parallel plan: unknown style {style!r} for {pattern!r}")
    if sp and hasattr(model, "seq_shards"):
        model.seq_shards *= t
    return tp


def _install_region(mod: nn.Module, mesh: ParallelMesh, sp: bool, tag: str) -> list:
    """Enter the region on the module's first input, leave it on its output."""
    enter = all_gather_from_sp if sp else copy_to_tp
    leave = reduce_scatter_to_sp if sp else reduce_from_tp

    def pre(_m, args):
        return (enter(args[0], mesh, DIM, tag=tag), *args[1:])

    def post(_m, _args, out):
        return leave(out, mesh, DIM, tag=tag)

    return [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]


# ---- full parameters, for parity and checkpoints -----------------------------------------

def gather_full_state(model: nn.Module, mesh: ParallelMesh, placements: PlacementTable,
                      local_state: dict[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
    """Full fp32 parameters by the reference's names: tp shards all-gathered, padding cut.

    `local_state` (by name) replaces the parameters' own values: ZeRO's `full_state()` gives
    this rank's whole tp shards (gathered over dp) and this completes them over tp.
    Collective over tp: every tp rank must call it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        meta = placements.of(p).split_on(DIM)
        local = widened((p if local_state is None else local_state[name]).detach())
        if meta is None or mesh.size(DIM) == 1:
            out[name] = local.clone()
            continue
        t = mesh.size(DIM)
        front = local.movedim(meta.axis, 0).contiguous()
        buf = torch.empty((t * front.shape[0], *front.shape[1:]), dtype=front.dtype,
                          device=front.device)
        ops.all_gather(buf, front, mesh, DIM, tag="state")
        slices = buf.view(t, *front.shape)[:: meta.replicas]
        full = slices.reshape(-1, *front.shape[1:]).movedim(0, meta.axis)
        out[name] = full.narrow(meta.axis, 0, meta.full_size).contiguous()
    return out
