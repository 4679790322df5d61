"""What the float8 recipes (`train.fp8_recipe`, `train.fp8_block`) refuse, each with its fix.

The blockwise recipe (plait/model/fp8_blockwise.py) scales each tile of B elements from
the tile's own amax and reduces no amax over ranks, so every rank's share of a tile must be
the whole tile: each tensor-parallel share of a split width must be a multiple of B (here),
and so must each context-parallel chunk of a sequence, along which the weight gradient's
tiles run (context parallel's record in plait/dims/ checks that).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from plait.dims import DIMENSIONS
from plait.dims.record import divisors_text

if TYPE_CHECKING:
    from plait.config import Config
    from plait.model.presets import ModelConfig

FP8_RECIPES = ("tensorwise", "blockwise")
# a chunk of up to 2^17 E4M3 products sums exactly in float64 (fp8_blockwise.py)
MAX_FP8_BLOCK = 2 ** 16


def tp_split_widths(m: ModelConfig, tp: int) -> dict[str, int]:
    """Each tensor-parallel block linear's split width on one rank: a column-parallel
    linear's output rows, a row-parallel one's input features (plait/parallel/tensor.py)."""
    if m.mla:
        out = {"attn.wq_b" if m.q_lora_rank else "attn.wq": m.n_heads * m.qk_head_dim // tp,
               "attn.wkv_b": m.n_heads * (m.qk_nope_head_dim + m.v_head_dim) // tp,
               "attn.wo": m.n_heads * m.v_head_dim // tp}
    else:
        kv_heads = m.n_kv_heads // tp if m.n_kv_heads % tp == 0 else 1  # else replicated
        out = {"attn.wq": m.n_heads * m.head_dim // tp, "attn.wk": kv_heads * m.head_dim,
               "attn.wv": kv_heads * m.head_dim, "attn.wo": m.n_heads * m.head_dim // tp}
    if m.n_experts == 0 or m.n_dense_layers > 0:  # MoE blocks are replicated over tp
        out.update({"mlp.w1": m.ffn_dim // tp, "mlp.w3": m.ffn_dim // tp,
                    "mlp.w2": m.ffn_dim // tp})
    return out


def _tile_problems(cfg: Config) -> list[str]:
    """The blockwise recipe's tiles against tensor parallel's splits, and MoE's token
    order (the module docstring)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    b, out = t.fp8_block, []
    if p.tp > 1 and all(n % p.tp == 0 for n in (m.n_heads, m.dim, m.ffn_dim)):
        widths = tp_split_widths(m, p.tp)
        bad = {name: w for name, w in widths.items() if w % b}
        if bad:
            shown = ", ".join(f"{name} {w}" for name, w in bad.items())
            common = math.gcd(*widths.values())
            out.append(f"train.fp8_block={b} with tp={p.tp}: each rank's share of a split "
                       f"width must be whole tiles, but {shown} are not multiples of {b}; "
                       f"set train.fp8_block to one of {divisors_text(common)}, or use tp=1")
    # experts or a sequence split over ranks: an expert's tokens arrive in another order
    # (context parallel's record checks its chunks' tiles itself)
    reordered = any(getattr(p, d.name) > 1 for d in DIMENSIONS
                    if d.splits in ("experts", "sequence"))
    if m.n_experts and (reordered or p.sp):
        out.append("train.fp8_recipe='blockwise' on a MoE model with expert, context or "
                   "sequence parallel is not built (an expert's weight-gradient tiles follow "
                   "its tokens' order, which these layouts change); use dp, tp without --sp, "
                   "pp and ZeRO, or --precision bf16")
    return out


def fp8_problems(cfg: Config) -> list[str]:
    """The recipe and its block: valid names and ranges, and the blockwise tiles whole on
    every rank."""
    t = cfg.train
    checks = [
        (t.fp8_recipe not in FP8_RECIPES,
         f"train.fp8_recipe={t.fp8_recipe!r}; use 'tensorwise' or 'blockwise'"),
        (t.fp8_recipe != "tensorwise" and t.precision != "fp8",
         f"train.fp8_recipe={t.fp8_recipe!r} applies to --precision fp8 only (it is "
         f"{t.precision!r}); drop --fp8-recipe or use --precision fp8"),
        (not 1 <= t.fp8_block <= MAX_FP8_BLOCK,
         f"train.fp8_block={t.fp8_block} must be in 1..{MAX_FP8_BLOCK} (DeepSeek-V3: 128)"),
        (t.fp8_block != 128 and t.fp8_recipe != "blockwise",
         f"train.fp8_block={t.fp8_block} sizes the blockwise recipe's tiles; add "
         "--fp8-recipe blockwise or drop the setting"),
    ]
    out = [problem for broken, problem in checks if broken]
    if not out and t.precision == "fp8" and t.fp8_recipe == "blockwise":
        out += _tile_problems(cfg)
    return out
