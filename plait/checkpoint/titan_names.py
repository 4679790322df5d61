"""torchtitan's names of plait's parameters, in both of its namings (docs/interop.md).

Sources, read for the names, shapes and axis orders (nothing copied): torchtitan,
torchtitan/models/llama3/state_dict_adapter.py and
torchtitan/models/deepseek_v3/state_dict_adapter.py at commit b5bcd76 (2026-08-21).
`2026` is the naming those files use; `2025` the one they used before torchtitan renamed
the Llama projections (under `qkv_linear`), the head (`lm_head`), the stacked experts
(`routed_experts.inner_experts.*_EFD`) and the balancing bias (`expert_bias_E`): the same
repository at commit 64dc922 (2025-12-12), torchtitan/models/llama3/model/
state_dict_adapter.py, torchtitan/models/deepseek_v3/model/state_dict_adapter.py
(`output.weight`, `moe.experts.w1/w2/w3`, `moe.expert_bias`) and
torchtitan/models/moe/moe.py (the stacks already E x F x D and E x D x F).

Every row of `TABLE` is one plait parameter: its torchtitan name in each naming, its
shape in torchtitan's axis letters and the file it comes from. `N` is the layer. Shapes
and row order are plait's in both namings: torchtitan rotates the interleaved pairs
(x_2i, x_2i+1) of each head as plait does (through `view_as_complex`), so no
permutation; its stacked experts keep plait's axis order (E experts, F the expert
width, D the model width: w1 and w3 E x F x D, w2 E x D x F), so no transpose.

Not mapped yet: DeepSeek-V3's multi-token prediction module (`enorm`, `hnorm`,
`eh_proj`, `mtp_norm`), which plait does not build.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from plait.model.presets import ModelConfig

NAMINGS = ("2026", "2025")
DEFAULT_NAMING = "2026"
LLAMA3 = "torchtitan/models/llama3/state_dict_adapter.py @ b5bcd76 (2026-08-21)"
DEEPSEEK_V3 = "torchtitan/models/deepseek_v3/state_dict_adapter.py @ b5bcd76 (2026-08-21)"

Shape = Callable[[ModelConfig], tuple[int, ...]]


@dataclass(frozen=True)
class Row:
    ours: str  # plait's name ("N": the layer)
    titan_2026: str
    titan_2025: str
    axes: str  # the shape in words: V vocabulary, D model width, E experts, F their width
    shape: Shape
    source: str

    def titan(self, naming: str) -> str:
        return self.titan_2026 if naming == "2026" else self.titan_2025


def _d(m: ModelConfig) -> tuple[int, ...]:
    return (m.dim,)


def _row(ours: str, theirs: str, axes: str, shape: Shape, source: str,
         before: str | None = None) -> Row:
    return Row(ours, theirs, before or theirs, axes, shape, source)


# the embedding, the final norm and the head (the head: absent where plait ties it)
OUTER = (
    _row("embed.weight", "tok_embeddings.weight", "V x D",
         lambda m: (m.vocab_size, m.dim), LLAMA3),
    _row("norm.weight", "norm.weight", "D", _d, LLAMA3),
    _row("head.weight", "lm_head.weight", "V x D", lambda m: (m.vocab_size, m.dim), LLAMA3,
         before="output.weight"),
)
NORMS = (
    _row("attn_norm.weight", "attention_norm.weight", "D", _d, LLAMA3),
    _row("mlp_norm.weight", "ffn_norm.weight", "D", _d, LLAMA3),
)
# grouped-query attention: the projections sit under `qkv_linear` since 2026
GQA = (
    _row("attn.wq.weight", "attention.qkv_linear.wq.weight", "H*Dh x D",
         lambda m: (m.n_heads * m.head_dim, m.dim), LLAMA3, before="attention.wq.weight"),
    _row("attn.wk.weight", "attention.qkv_linear.wk.weight", "Hkv*Dh x D",
         lambda m: (m.n_kv_heads * m.head_dim, m.dim), LLAMA3, before="attention.wk.weight"),
    _row("attn.wv.weight", "attention.qkv_linear.wv.weight", "Hkv*Dh x D",
         lambda m: (m.n_kv_heads * m.head_dim, m.dim), LLAMA3, before="attention.wv.weight"),
    _row("attn.wo.weight", "attention.wo.weight", "D x H*Dh",
         lambda m: (m.dim, m.n_heads * m.head_dim), LLAMA3),
)
# multi-head latent attention: the query latent (wq_a, q_norm, wq_b) or, without one, wq
MLA_QUERY_LATENT = (
    _row("attn.wq_a.weight", "attention.wq_a.weight", "Rq x D",
         lambda m: (m.q_lora_rank, m.dim), DEEPSEEK_V3),
    _row("attn.q_norm.weight", "attention.q_norm.weight", "Rq",
         lambda m: (m.q_lora_rank,), DEEPSEEK_V3),
    _row("attn.wq_b.weight", "attention.wq_b.weight", "H*(Dn+Dr) x Rq",
         lambda m: (m.n_heads * m.qk_head_dim, m.q_lora_rank), DEEPSEEK_V3),
)
MLA_QUERY = (
    _row("attn.wq.weight", "attention.wq.weight", "H*(Dn+Dr) x D",
         lambda m: (m.n_heads * m.qk_head_dim, m.dim), DEEPSEEK_V3),
)
MLA = (
    _row("attn.wkv_a.weight", "attention.wkv_a.weight", "(Rkv+Dr) x D",
         lambda m: (m.kv_lora_rank + m.qk_rope_head_dim, m.dim), DEEPSEEK_V3),
    _row("attn.kv_norm.weight", "attention.kv_norm.weight", "Rkv",
         lambda m: (m.kv_lora_rank,), DEEPSEEK_V3),
    _row("attn.wkv_b.weight", "attention.wkv_b.weight", "H*(Dn+Dv) x Rkv",
         lambda m: (m.n_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
         DEEPSEEK_V3),
    _row("attn.wo.weight", "attention.wo.weight", "D x H*Dv",
         lambda m: (m.dim, m.n_heads * m.v_head_dim), DEEPSEEK_V3),
)
DENSE_MLP = (
    _row("mlp.w1.weight", "feed_forward.w1.weight", "Ffn x D",
         lambda m: (m.ffn_dim, m.dim), LLAMA3),
    _row("mlp.w3.weight", "feed_forward.w3.weight", "Ffn x D",
         lambda m: (m.ffn_dim, m.dim), LLAMA3),
    _row("mlp.w2.weight", "feed_forward.w2.weight", "D x Ffn",
         lambda m: (m.dim, m.ffn_dim), LLAMA3),
)
# routed experts stacked per layer, one tensor per weight; the axis order is in the name
MOE = (
    _row("mlp.bias", "moe.expert_bias_E", "E", lambda m: (m.n_experts,), DEEPSEEK_V3,
         before="moe.expert_bias"),
    _row("mlp.router.weight", "moe.router.gate.weight", "E x D",
         lambda m: (m.n_experts, m.dim), DEEPSEEK_V3),
    _row("mlp.experts.w1", "moe.routed_experts.inner_experts.w1_EFD", "E x F x D",
         lambda m: (m.n_experts, m.expert_ffn_dim, m.dim), DEEPSEEK_V3,
         before="moe.experts.w1"),
    _row("mlp.experts.w3", "moe.routed_experts.inner_experts.w3_EFD", "E x F x D",
         lambda m: (m.n_experts, m.expert_ffn_dim, m.dim), DEEPSEEK_V3,
         before="moe.experts.w3"),
    _row("mlp.experts.w2", "moe.routed_experts.inner_experts.w2_EDF", "E x D x F",
         lambda m: (m.n_experts, m.dim, m.expert_ffn_dim), DEEPSEEK_V3,
         before="moe.experts.w2"),
)
SHARED_EXPERTS = (  # plait's shared experts are one MLP of n_shared x F rows, as torchtitan's
    _row("mlp.shared.w1.weight", "moe.shared_experts.w1.weight", "S*F x D",
         lambda m: (m.n_shared_experts * m.expert_ffn_dim, m.dim), DEEPSEEK_V3),
    _row("mlp.shared.w3.weight", "moe.shared_experts.w3.weight", "S*F x D",
         lambda m: (m.n_shared_experts * m.expert_ffn_dim, m.dim), DEEPSEEK_V3),
    _row("mlp.shared.w2.weight", "moe.shared_experts.w2.weight", "D x S*F",
         lambda m: (m.dim, m.n_shared_experts * m.expert_ffn_dim), DEEPSEEK_V3),
)
TABLE = (*OUTER, *NORMS, *GQA, *MLA_QUERY_LATENT, *MLA_QUERY, *MLA, *DENSE_MLP, *MOE,
         *SHARED_EXPERTS)
# torchtitan state beside the weights that plait derives or does not keep: ignored on read
IGNORED = ("freqs_cis", "tokens_per_expert", "tokens_per_expert_E")


def layer_rows(m: ModelConfig, layer: int) -> tuple[Row, ...]:
    """The rows of layer `layer` of model `m`, in plait's parameter order."""
    if m.mla:
        attention = (*(MLA_QUERY_LATENT if m.q_lora_rank else MLA_QUERY), *MLA)
    else:
        attention = GQA
    if m.n_experts and layer >= m.n_dense_layers:
        mlp = (*MOE, *(SHARED_EXPERTS if m.n_shared_experts else ()))
    else:
        mlp = DENSE_MLP
    return (NORMS[0], *attention, NORMS[1], *mlp)


def names(m: ModelConfig, naming: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """plait name -> (torchtitan's name in `naming`, shape), every parameter of `m` and
    each MoE block's balancing bias. A tied model has no `head.weight`."""
    if naming not in NAMINGS:
        raise ValueError(f"naming {naming!r}: one of {', '.join(NAMINGS)}")
    out = {OUTER[0].ours: (OUTER[0].titan(naming), OUTER[0].shape(m))}
    for i in range(m.n_layers):
        for row in layer_rows(m, i):
            out[f"layers.{i}.{row.ours}"] = (f"layers.{i}.{row.titan(naming)}", row.shape(m))
    out[OUTER[1].ours] = (OUTER[1].titan(naming), OUTER[1].shape(m))
    if not m.tie_embeddings:
        out[OUTER[2].ours] = (OUTER[2].titan(naming), OUTER[2].shape(m))
    return out


def head_name(naming: str) -> str:
    return OUTER[2].titan(naming)


def is_ignored(theirs: str) -> bool:
    """State torchtitan keeps beside the weights that plait does not read."""
    return re.sub(r".*\.", "", theirs) in IGNORED or theirs in IGNORED


def detect(keys: set[str], m: ModelConfig) -> str:
    """The naming of a checkpoint whose tensor names (prefix removed) are `keys`: the one
    more of model `m`'s names are found in; where both find as many (a model whose names
    agree in both, or a checkpoint of another model) today's."""
    found = {n: sum(theirs in keys for theirs, _ in names(m, n).values()) for n in NAMINGS}
    return max(NAMINGS, key=lambda n: (found[n], n == DEFAULT_NAMING))


def marks(naming: str) -> str:
    """The names that tell a naming apart, for messages."""
    rows = (GQA[0], OUTER[2], MOE[2])
    return ", ".join(r.titan(naming).replace("attention.", "layers.N.attention.", 1)
                     .replace("moe.", "layers.N.moe.", 1) for r in rows)
