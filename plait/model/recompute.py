"""Activation recomputation: what a block keeps for backward and what it computes again.

Three modes (`train.recompute`), applied to each block by the one layer loop
(`run_blocks`), on torch's non-reentrant checkpoint (Chen et al. 2016):

  none        autograd keeps every tensor a block's backward reads;
  full        each block keeps only its input; backward runs the block's forward again;
  selective   torch's selective activation checkpointing (`create_selective_checkpoint_
              contexts` with a `CheckpointPolicy` per operator): the forward also keeps
              the outputs of the operator groups *not* named in `train.recompute_ops`,
              and backward's re-run of the forward returns those instead of computing them.

The operator groups (`OP_GROUPS`; every aten operator is in exactly one):

  matmul       aten.mm / addmm / _grouped_mm: the linears (and the grouped experts);
  attention    the fused attention kernels (SDPA's flash / efficient / cuDNN, the CPU
               flash kernel) and bmm / baddbmm (attention's unfused maths, ring
               attention's plain-matmul blocks; no linear of ours is a bmm);
  elementwise  everything else: RMSNorm, RoPE, SiLU and the SwiGLU product, residual adds,
               casts, views, and any collective a strategy put inside the block.

The default, `recompute_ops = ("attention", "elementwise")`, saves the matmul outputs and
recomputes the rest: the matmuls are where the FLOPs are (about 24·b·s·h² of a layer's
forward against 4·b·s²·h for the attention core), the element-wise and normalisation ops
are memory-bound and cheap to redo, and the attention core's saved tensors (q, k, v, the
output and its log-sum-exp) are rebuilt from the saved q/k/v projections at the price of
one attention forward. `elementwise` must always be recomputed: a cached output of an
in-place collective (all-reduce into a buffer, as tensor parallel's regions do) would not
land in the buffer the re-run allocates, and saving every element-wise output keeps more
than no recomputation at all. The kept bytes per layer are
plait/plan/activations.py's `layer_saved_bytes`, measured to the byte
(tests/test_recompute.py).

A pipeline stage whose backward is split into I and W runs the same policy over the whole
stage instead (`contexts`; plait/parallel/pipeline/runtime.py, docs/recompute.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as ckpt
from torch import nn

from plait.model.presets import ModelConfig
from plait.model.recompute_settings import DEFAULT_OPS, GROUPS, MODES

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The default overloads of these aten operators (those this torch build has)."""
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


OP_GROUPS: dict[str, frozenset] = {
    "matmul": _ops("mm", "addmm", "_grouped_mm"),
    "attention": _ops("_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                      "_efficient_attention_forward", "bmm", "baddbmm"),
}


def op_group(op: Any) -> str:
    """The group (`GROUPS`) an operator overload belongs to."""
    for name, ops in OP_GROUPS.items():
        if op in ops:
            return name
    return "elementwise"


@dataclass(frozen=True)
class Recompute:
    """One recomputation setting: `mode` full or selective, and (selective) the groups
    recomputed; the groups not in `ops` are saved."""

    mode: str
    ops: tuple[str, ...] = DEFAULT_OPS

    @classmethod
    def of(cls, mode: str, ops: tuple[str, ...] = DEFAULT_OPS) -> Recompute | None:
        """The setting for `train.recompute` / `train.recompute_ops`; None for 'none'."""
        if mode not in MODES:
            raise ValueError(f"recompute={mode!r}; use one of {', '.join(MODES)}")
        return None if mode == "none" else cls(mode, tuple(ops))

    @property
    def saved_groups(self) -> tuple[str, ...]:
        """The groups whose outputs the forward keeps (none under full)."""
        if self.mode == "full":
            return ()
        return tuple(g for g in GROUPS if g not in self.ops)

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> ckpt.CheckpointPolicy:
        """torch's per-operator decision: keep the output, or compute it again."""
        if op_group(op) in self.saved_groups:
            return ckpt.CheckpointPolicy.MUST_SAVE
        return ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    def contexts(self) -> tuple[contextlib.AbstractContextManager,
                                contextlib.AbstractContextManager]:
        """(forward, recompute) contexts sharing one fresh store of saved outputs."""
        if not self.saved_groups:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return ckpt.create_selective_checkpoint_contexts(self.policy)

    def block(self, block: nn.Module, *args: Any) -> Any:
        """block(*args), keeping only its inputs (and the saved groups' outputs)."""
        return ckpt.checkpoint(block, *args, use_reentrant=False, context_fn=self.contexts)


def extra_forward_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: Recompute | None,
                                  split_backward: bool = False) -> float:
    """FLOPs per token a step adds by recomputing, on the convention of
    `ModelConfig.flops_per_token` (2 per multiply-add, causal attention at half): each
    recomputed matmul's and attention core's forward once per micro-batch; element-wise
    ops are memory-bound and not counted. `split_backward`: the whole stage runs again
    (plait/parallel/pipeline/runtime.py), so the LM head's matmul is recomputed too when
    the matmul group is (always under full); the embedding is a lookup."""
    if recompute is None:
        return 0.0
    h, f = cfg.dim, cfg.ffn_dim
    if cfg.n_experts:  # routed experts (active per token), shared experts and the router
        f = cfg.expert_ffn_dim * (cfg.top_k + cfg.n_shared_experts)
    matmul = 2 * (cfg.attention_matmul_params() + 3 * h * f)
    attention = cfg.attention_core_flops(seq_len)
    redone = set(GROUPS) if recompute.mode == "full" else set(recompute.ops)
    per_layer = matmul * ("matmul" in redone) + attention * ("attention" in redone)
    head = 2 * h * cfg.vocab_size * ("matmul" in redone and split_backward)
    return cfg.n_layers * per_layer + head
