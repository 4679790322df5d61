"""Rotary position embedding (Su et al. 2021): tables, the rotation, and a per-device cache.

A forward's tokens need not be the contiguous positions 0..s-1 of one sequence: a strategy
that splits the sequence (context parallel's load-balanced chunks) holds positions out of
order. `Positions` says where each token sits and carries its rotation; the attention core
reads it for the causal mask, the attention for RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from plait.model.precision import widened
from plait.model.presets import ModelConfig


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's RoPE frequency scaling, as in Meta's reference code (llama-models,
    `apply_scaling`; the Llama 3.1 release, Dubey et al. 2024): with wavelength
    w_i = 2 pi / f_i, L the original context, lo/hi the low/high frequency factors,
      w_i < L/hi            f_i kept (high frequencies),
      w_i > L/lo            f_i / factor (low frequencies),
      otherwise             (1 - g) f_i / factor + g f_i,  g = (L/w_i - lo) / (hi - lo).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_len: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = self.original_max_len / self.low_freq_factor
        high_wavelen = self.original_max_len / self.high_freq_factor
        smooth = ((self.original_max_len / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        mid = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / self.factor, mid)
        return torch.where(wavelen < high_wavelen, inv_freq, out)


def rope_scaling(cfg: ModelConfig) -> Llama3Scaling | None:
    """The model's RoPE frequency scaling; None when model.rope_scaling_factor is 1."""
    if cfg.rope_scaling_factor == 1.0:
        return None
    return Llama3Scaling(cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                         cfg.rope_high_freq_factor, cfg.rope_original_max_len)


def rope_tables(head_dim: int, seq_len: int, theta: float,
                scaling: Llama3Scaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (seq_len, head_dim/2) (Su et al. 2021); `scaling`: Llama
    3.1's frequency scaling (None: the plain frequencies, unchanged)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (batch, heads, seq, head_dim); cos, sin broadcast
    against (batch, heads, seq, head_dim/2)."""
    x1, x2 = widened(x[..., 0::2]), widened(x[..., 1::2])
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


@dataclass(frozen=True)
class Positions:
    """Where the tokens of one forward sit in the full sequence, and their RoPE rotation.

    ids: int64 (s,) or (batch, s), or None for the contiguous 0..s-1 (the common case: the
    causal mask is the plain triangle and nothing needs materialising).
    cos, sin: the rotation at those positions, fp32, (s, d/2) or (batch, 1, s, d/2).
    docs: packed documents (plait/model/packed.py): the document of every token of the
    full sequence, int64 (batch, seq_len), or None for one sequence. The rotation is then
    at each token's position inside its document; `ids` stay sequence indices.
    """

    ids: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    docs: torch.Tensor | None = None

    @property
    def contiguous(self) -> bool:
        return self.ids is None

    def index(self) -> torch.Tensor:
        """The positions as a tensor, built on demand for the contiguous case."""
        if self.ids is not None:
            return self.ids
        return torch.arange(self.cos.shape[-2], device=self.cos.device)


def _canonical(device: torch.device | str) -> torch.device:
    """`cuda` and the tensors' `cuda:0` are one cache entry: name the index."""
    d = torch.device(device)
    if d.index is None and d.type not in ("cpu", "meta"):
        d = torch.device(d.type, torch.get_device_module(d.type).current_device())
    return d


class RotaryEmbedding(nn.Module):
    """RoPE tables cached per (device, length) and gathered by position.

    No parameters and no buffers (the state dict and parameter names are the model's
    alone, and a dtype cast leaves the fp32 tables alone). Tables are built on the CPU in
    float64 and cast to fp32 exactly as `rope_tables` always did, then moved: every device
    sees the same values. One table of max(max_len, s) rows serves every shorter sequence
    (its rows are bit-identical to a table built for the shorter length).
    """

    def __init__(self, head_dim: int, theta: float, max_len: int,
                 scaling: Llama3Scaling | None = None):
        super().__init__()
        self.head_dim, self.theta, self.max_len = head_dim, theta, max_len
        self.scaling = scaling
        self._tables: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device | str, seq_len: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (cos, sin) of at least seq_len rows on `device`."""
        key = (_canonical(device), max(seq_len, self.max_len))
        if key not in self._tables:
            cos, sin = rope_tables(self.head_dim, key[1], self.theta, self.scaling)
            self._tables[key] = (cos.to(key[0]), sin.to(key[0]))
        return self._tables[key]

    def warm(self, device: torch.device | str) -> None:
        """Build the table for max_len on `device` now (at materialisation), so no training
        step allocates it."""
        self.tables(device, self.max_len)

    def forward(self, seq_len: int, device: torch.device | str,
                ids: torch.Tensor | None = None, docs: torch.Tensor | None = None
                ) -> Positions:
        """Positions of a forward over `seq_len` tokens (the full sequence's length), at
        `ids` (int64 (s,) or (batch, s), each below max(max_len, seq_len)) or 0..seq_len-1;
        `docs` (batch, seq_len): packed documents (`Positions.docs`).

        The rotation is a fresh copy, never a view of the cache: a forward owns its
        (s, d/2) pair, freed with its autograd graph, as before the cache.
        """
        cos, sin = self.tables(device, seq_len)
        if docs is not None:  # rotated by the position inside each token's document
            from plait.model.packed import document_positions

            inner = document_positions(docs)
            if ids is not None:  # (s,) one split for every row, or (batch, s) per row
                inner = inner.gather(1, ids) if ids.dim() == 2 else inner[:, ids]
            return Positions(ids, cos[inner].unsqueeze(1), sin[inner].unsqueeze(1), docs)
        if ids is None:
            return Positions(None, cos.narrow_copy(0, 0, seq_len),
                             sin.narrow_copy(0, 0, seq_len))
        c, s = cos[ids], sin[ids]
        if ids.dim() == 2:  # (batch, s, d/2) -> broadcast over the heads
            c, s = c.unsqueeze(1), s.unsqueeze(1)
        return Positions(ids, c, s)
