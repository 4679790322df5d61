"""Hugging Face DeepSeek-V3-shaped models (transformers' `DeepseekV3ForCausalLM`,
model_type deepseek_v3) in and out: config.json <-> ModelConfig, tensor names
(docs/deepseek.md). plait/checkpoint/hf.py reads and plait/checkpoint/hf_export.py writes
through these tables.

Names: `self_attn.q_a_proj` is plait's `attn.wq_a`, `q_a_layernorm` `q_norm`, `q_b_proj`
`wq_b` (`q_proj` `wq` without a query latent), `kv_a_proj_with_mqa` `wkv_a`,
`kv_a_layernorm` `kv_norm`, `kv_b_proj` `wkv_b`, `o_proj` `wo`; an MoE layer's
`mlp.gate.weight` is the router, `mlp.gate.e_score_correction_bias` the balancing bias,
`mlp.experts.N.{gate,up,down}_proj` row N of plait's stacked `experts.w1`, `w3`, `w2`,
`mlp.shared_experts.*` the shared expert. The multi-token prediction layers the
checkpoint may carry after the last layer (`num_nextn_predict_layers`) are not read.

RoPE: DeepSeek's weights hold the RoPE features in interleaved pairs (x_{2i}, x_{2i+1})
(`rope_interleave: true`, transformers' default for this model), plait's own pairing, so
no row is permuted. A checkpoint with `rope_interleave: false` (halves) is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

from plait.model.presets import ModelConfig

from .format import CheckpointError

MODEL_TYPE = "deepseek_v3"
# transformers' DeepseekV3RMSNorm on the latents takes its default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


class DeepSeekConfigError(CheckpointError):
    """A DeepSeek config.json plait cannot represent; the message names the field."""


def _int(c: dict, key: str, path: Path, default: int | None = None, low: int = 1) -> int:
    v = c.get(key, default)
    if v is None or not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise DeepSeekConfigError(f"{path}: {key}={v!r} must be an integer >= {low}")
    return v


def _refusals(c: dict, path: Path) -> None:
    if c.get("quantization_config"):
        raise DeepSeekConfigError(f"{path}: quantization_config: the weights are quantized "
                                  "(DeepSeek-V3's FP8 release); convert them to bf16 first")
    if c.get("attention_bias"):
        raise DeepSeekConfigError(f"{path}: attention_bias=true: plait's block has no biases")
    if not c.get("rope_interleave", True):
        raise DeepSeekConfigError(f"{path}: rope_interleave=false: plait reads DeepSeek's "
                                  "interleaved RoPE features only")
    if c.get("hidden_act", "silu") != "silu":
        raise DeepSeekConfigError(f"{path}: hidden_act={c.get('hidden_act')!r}: plait's "
                                  "MLPs are SwiGLU (silu)")
    if c.get("scoring_func", "sigmoid") != "sigmoid" or c.get("topk_method",
                                                               "noaux_tc") != "noaux_tc":
        raise DeepSeekConfigError(f"{path}: plait routes as DeepSeek-V3 does (sigmoid "
                                  "scores, topk_method noaux_tc)")
    # transformers 4 writes rope_scaling, 5 rope_parameters: a scaling in either is refused
    kinds = [t.get("rope_type", t.get("type")) for t in (c.get("rope_scaling") or {},
                                                         c.get("rope_parameters") or {})]
    kind = next((k for k in kinds if k not in ("default", None)), None)
    if kind is not None:
        raise DeepSeekConfigError(
            f"{path}: rope_type={kind!r}: plait's RoPE has no {kind} scaling (DeepSeek-V3 "
            "was pre-trained at 4K without it); remove rope_scaling / set rope_type "
            "'default' in a copy of config.json to train at the original length")
    eps = float(c.get("rms_norm_eps", 1e-6))
    if eps != LATENT_NORM_EPS:
        raise DeepSeekConfigError(f"{path}: rms_norm_eps={eps}: transformers normalises the "
                                  f"latents with eps {LATENT_NORM_EPS} whatever this says, "
                                  "plait every norm with one eps; use 1e-06")


def model_config(c: dict, path: Path) -> ModelConfig:
    """The plait model of a deepseek_v3 config.json (DeepSeekConfigError naming the field
    plait cannot represent)."""
    _refusals(c, path)
    heads = _int(c, "num_attention_heads", path)
    experts = _int(c, "n_routed_experts", path, 0, low=0)
    k = _int(c, "num_experts_per_tok", path, 0, low=0)
    groups = _int(c, "n_group", path, 1)
    top_groups = _int(c, "topk_group", path, 1)
    if experts and top_groups < groups and k // top_groups != 2:
        raise DeepSeekConfigError(f"{path}: num_experts_per_tok={k}, topk_group="
                                  f"{top_groups}: DeepSeek scores a group by its top 2 "
                                  "experts, plait by its top k / topk_group; they agree when "
                                  "that is 2")
    params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    layers = _int(c, "num_hidden_layers", path)
    return ModelConfig(
        vocab_size=_int(c, "vocab_size", path), dim=_int(c, "hidden_size", path),
        n_layers=layers, n_heads=heads, n_kv_heads=heads,
        ffn_dim=_int(c, "intermediate_size", path),
        max_seq_len=_int(c, "max_position_embeddings", path, 2048),
        rope_theta=float(params.get("rope_theta", c.get("rope_theta", 10000.0))),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_std=float(c.get("initializer_range", 0.02)),
        attention="mla", q_lora_rank=c.get("q_lora_rank") or 0,
        kv_lora_rank=_int(c, "kv_lora_rank", path),
        qk_nope_head_dim=_int(c, "qk_nope_head_dim", path),
        qk_rope_head_dim=_int(c, "qk_rope_head_dim", path),
        v_head_dim=_int(c, "v_head_dim", path),
        n_experts=experts, top_k=k,
        expert_ffn_dim=_int(c, "moe_intermediate_size", path, 0, low=0) if experts else 0,
        n_shared_experts=_int(c, "n_shared_experts", path, 0, low=0) if experts else 0,
        n_dense_layers=min(_int(c, "first_k_dense_replace", path, 0, low=0), layers)
        if experts else 0,
        router_score="sigmoid", norm_topk=bool(c.get("norm_topk_prob", True)),
        routed_scale=float(c.get("routed_scaling_factor", 1.0)),
        route_groups=groups if experts and groups > 1 else 0,
        route_max_groups=top_groups if experts and groups > 1 else 0)


def hf_config(m: ModelConfig, dtype_name: str) -> dict:
    """config.json of a DeepseekV3ForCausalLM with plait's model `m`."""
    groups = m.route_groups or 1
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": MODEL_TYPE,
            "vocab_size": m.vocab_size, "hidden_size": m.dim,
            "intermediate_size": m.ffn_dim, "moe_intermediate_size": m.expert_ffn_dim,
            "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_heads, "n_shared_experts": m.n_shared_experts,
            "n_routed_experts": m.n_experts, "num_experts_per_tok": m.top_k,
            "routed_scaling_factor": m.routed_scale, "n_group": groups,
            "topk_group": m.route_max_groups or groups,
            "first_k_dense_replace": m.n_dense_layers if m.n_experts else m.n_layers,
            "norm_topk_prob": m.norm_topk, "kv_lora_rank": m.kv_lora_rank,
            "q_lora_rank": m.q_lora_rank or None, "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
            "hidden_act": "silu", "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps, "initializer_range": m.init_std,
            "tie_word_embeddings": m.tie_embeddings, "attention_bias": False,
            "rope_interleave": True, "rope_theta": m.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "num_nextn_predict_layers": 0, "torch_dtype": dtype_name}


def _attention(m: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    a, d, qk = m.n_heads, m.dim, m.qk_head_dim
    out = {}
    if m.q_lora_rank:
        out.update({"attn.wq_a.weight": ("self_attn.q_a_proj.weight", (m.q_lora_rank, d)),
                    "attn.q_norm.weight": ("self_attn.q_a_layernorm.weight",
                                           (m.q_lora_rank,)),
                    "attn.wq_b.weight": ("self_attn.q_b_proj.weight",
                                         (a * qk, m.q_lora_rank))})
    else:
        out["attn.wq.weight"] = ("self_attn.q_proj.weight", (a * qk, d))
    kv = m.kv_lora_rank
    out.update({
        "attn.wkv_a.weight": ("self_attn.kv_a_proj_with_mqa.weight",
                              (kv + m.qk_rope_head_dim, d)),
        "attn.kv_norm.weight": ("self_attn.kv_a_layernorm.weight", (kv,)),
        "attn.wkv_b.weight": ("self_attn.kv_b_proj.weight",
                              (a * (m.qk_nope_head_dim + m.v_head_dim), kv)),
        "attn.wo.weight": ("self_attn.o_proj.weight", (d, a * m.v_head_dim))})
    return out


def _mlp(m: ModelConfig, moe: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    d = m.dim
    if not moe:
        f = m.ffn_dim
        return {"mlp.w1.weight": ("mlp.gate_proj.weight", (f, d)),
                "mlp.w3.weight": ("mlp.up_proj.weight", (f, d)),
                "mlp.w2.weight": ("mlp.down_proj.weight", (d, f))}
    n, f = m.n_experts, m.expert_ffn_dim
    out = {"mlp.router.weight": ("mlp.gate.weight", (n, d)),
           "mlp.bias": ("mlp.gate.e_score_correction_bias", (n,)),
           # "{}": one Hugging Face tensor per expert, row N of plait's stacked weight
           "mlp.experts.w1": ("mlp.experts.{}.gate_proj.weight", (n, f, d)),
           "mlp.experts.w3": ("mlp.experts.{}.up_proj.weight", (n, f, d)),
           "mlp.experts.w2": ("mlp.experts.{}.down_proj.weight", (n, d, f))}
    if m.n_shared_experts:
        fs = f * m.n_shared_experts
        out.update({"mlp.shared.w1.weight": ("mlp.shared_experts.gate_proj.weight", (fs, d)),
                    "mlp.shared.w3.weight": ("mlp.shared_experts.up_proj.weight", (fs, d)),
                    "mlp.shared.w2.weight": ("mlp.shared_experts.down_proj.weight",
                                             (d, fs))})
    return out


def weight_names(m: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """plait name -> (Hugging Face name, shape), in the model's order; a stacked expert
    weight's name holds "{}" for the expert index (`per_expert` expands it)."""
    d = m.dim
    out = {"embed.weight": ("model.embed_tokens.weight", (m.vocab_size, d))}
    for i in range(m.n_layers):
        moe = bool(m.n_experts) and i >= m.n_dense_layers
        layer = {"attn_norm.weight": ("input_layernorm.weight", (d,)), **_attention(m),
                 "mlp_norm.weight": ("post_attention_layernorm.weight", (d,)),
                 **_mlp(m, moe)}
        for ours, (theirs, shape) in layer.items():
            out[f"layers.{i}.{ours}"] = (f"model.layers.{i}.{theirs}", shape)
    out["norm.weight"] = ("model.norm.weight", (d,))
    if not m.tie_embeddings:
        out["head.weight"] = ("lm_head.weight", (m.vocab_size, d))
    return out


def per_expert(hf_name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face tensors behind one entry of `weight_names`."""
    if "{}" not in hf_name:
        return [(hf_name, shape)]
    return [(hf_name.format(e), shape[1:]) for e in range(shape[0])]


def beyond_the_layers(hf_name: str, m: ModelConfig) -> bool:
    """A tensor of a layer after the model's last: the multi-token prediction module(s)."""
    found = re.match(r"model\.layers\.(\d+)\.", hf_name)
    return found is not None and int(found.group(1)) >= m.n_layers
