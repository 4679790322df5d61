"""`plait export ... --to hf:OUT` (plait/checkpoint/interop.py): a directory
`transformers.AutoModelForCausalLM.from_pretrained` loads (docs/huggingface.md).

OUT holds config.json, the weights (`export.write_shards`: through the safetensors
library, `model.safetensors`, or shards of at most 5 GB with their index as transformers
writes them) and the tokenizer files when the source has them: a Hugging Face source's
own, a checkpoint's from the Hugging Face directory it was started from
(`train.init_from`), or else the tokenizer its token file was prepared with. Names and
the RoPE row order are mapped back (the inverse of plait/checkpoint/hf.py's permutation),
so importing a Hugging Face directory and exporting it again gives the same tensors bit
for bit (fp32 and bf16 both convert to fp32 exactly).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from plait.model.presets import ModelConfig

from . import hf, hf_deepseek
from .export import SHARD_BYTES, write_shards
from .source import Source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def hf_config(m: ModelConfig, dtype: str) -> dict:
    """config.json of a LlamaForCausalLM with plait's model `m`. RoPE is written both
    ways transformers reads it (4.x: rope_theta + rope_scaling; 5.x: rope_parameters)."""
    rope: dict = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling_factor != 1.0:
        rope.update(rope_type="llama3", factor=m.rope_scaling_factor,
                    low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_len)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": m.vocab_size, "hidden_size": m.dim,
            "intermediate_size": m.ffn_dim, "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.head_dim, "hidden_act": "silu",
            "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
            "initializer_range": m.init_std, "tie_word_embeddings": m.tie_embeddings,
            "attention_bias": False, "mlp_bias": False, "rope_theta": m.rope_theta,
            "rope_scaling": scaling if m.rope_scaling_factor != 1.0 else None,
            "rope_parameters": rope, "torch_dtype": TORCH_DTYPE[dtype]}


def _config(src: Source, dtype: str) -> dict:
    """The origin's config.json (its ids, its extras) where it is this very model; else
    a fresh one."""
    if src.origin is not None and hf.model_config(src.origin) == src.model:
        c = hf.read_config_json(src.origin)
        c["torch_dtype"] = TORCH_DTYPE[dtype]
        c.pop("dtype", None)
        return c
    if src.model.mla:
        return hf_deepseek.hf_config(src.model, TORCH_DTYPE[dtype])
    return hf_config(src.model, dtype)


def write_hf(src: Source, out: Path, dtype: str, shard_bytes: int = SHARD_BYTES) -> int:
    """`src` as a Hugging Face directory in `out` (an empty directory): the weights in
    Hugging Face's names and RoPE row order, config.json and the tokenizer files; returns
    the tensors written."""
    m = src.model
    names = hf.weight_names(m)
    last: dict[str, torch.Tensor] = {}  # a stacked expert weight, read once for its rows
    # every Hugging Face tensor: a stacked expert weight is one a row (DeepSeek's names)
    tensors = {t: s for theirs, shape in names.values()
               for t, s in hf_deepseek.per_expert(theirs, shape)}
    by_hf = {t: (ours, (e if "{}" in theirs else None)) for ours, (theirs, shape)
             in names.items()
             for e, (t, _) in enumerate(hf_deepseek.per_expert(theirs, shape))}

    def load(hf_name: str) -> torch.Tensor:
        ours, expert = by_hf[hf_name]
        if expert is not None:
            if ours not in last:
                last.clear()
                last[ours] = src.load(ours)
            return last[ours][expert]
        t = src.load(ours)
        perm = hf.row_permutation(ours, m)
        return t if perm is None else t[torch.argsort(perm)]

    write_shards(out, tensors, load, dtype,
                 {"format": "pt", "plait_source": src.describe}, shard_bytes)
    (out / "config.json").write_text(json.dumps(_config(src, dtype), indent=2) + "\n")
    if src.origin is not None:
        for name in TOKENIZER_FILES:
            if (src.origin / name).is_file():
                shutil.copyfile(src.origin / name, out / name)
    elif src.tokenizer_json is not None:
        shutil.copyfile(src.tokenizer_json, out / "tokenizer.json")
    return len(tensors)
