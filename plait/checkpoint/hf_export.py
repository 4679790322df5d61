"""`plait export --from CHECKPOINT|hf:DIR --to hf:OUT [--dtype fp32|bf16]`: a directory
`transformers.AutoModelForCausalLM.from_pretrained` loads (docs/huggingface.md).

OUT holds config.json, model.safetensors (written by `export.write_safetensors`, the
writer `plait checkpoint consolidate` uses: one tensor in memory at a time) and the
tokenizer files when the source has them: a Hugging Face source's own, a checkpoint's
from the Hugging Face directory it was started from (`train.init_from`), or else the
tokenizer its token file was prepared with. Names and the RoPE row order are mapped back
(the inverse of plait/checkpoint/hf.py's permutation), so importing a Hugging Face
directory and exporting it again gives the same tensors bit for bit (fp32 and bf16 both
convert to fp32 exactly). OUT is built under a temporary name and renamed into place: a
failed export leaves nothing, and an existing OUT is refused, never clobbered.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from plait.model.presets import ModelConfig

from . import hf, hf_deepseek
from .export import DTYPES, write_safetensors
from .format import CheckpointError
from .init_from import checkpoint_model, checkpoint_source
from .reader import full_tensor

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


class Source:
    """What an export reads: the model, each parameter whole in plait's order, and where
    the Hugging Face config and tokenizer files come from (if anywhere)."""

    def __init__(self, source: str):
        directory = hf.hf_dir(source)
        self.tokenizer_json: Path | None = None  # a plait token file's tokenizer
        if directory is not None:
            self.model = hf.model_config(directory)
            weights = hf.HFWeights(directory, self.model)
            weights.check()
            self.load: Callable[[str], torch.Tensor] = weights.full
            self.origin: Path | None = directory
            self.describe = f"hf:{directory}"
            return
        path, meta = checkpoint_source(source)
        self.model = checkpoint_model(meta)
        self.load = lambda n: torch.from_numpy(full_tensor(path, meta, n))
        self.describe = str(path)
        train = meta["config"]["train"]
        self.origin = hf.hf_dir(train.get("init_from"))
        if self.origin is not None and not self.origin.is_dir():
            self.origin = None
        data = train.get("data")
        if data:
            side = Path(data).with_suffix(".json")
            try:
                name = json.loads(side.read_text()).get("tokenizer")
            except (OSError, ValueError, AttributeError):
                name = None
            if isinstance(name, str) and (side.parent / name).is_file():
                self.tokenizer_json = side.parent / name


def _out_dir(target: str) -> Path:
    d = hf.hf_dir(target)
    if d is None:
        raise CheckpointError(f"--to {target}: name the output as hf:DIR")
    return d


def export_problems(target: str, dtype: str) -> list[str]:
    """The output's problems, before anything is read or written."""
    try:
        out = _out_dir(target)
    except CheckpointError as e:
        return [str(e)]
    problems = [] if dtype in DTYPES else [f"--dtype {dtype}: choose one of fp32, bf16"]
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        problems.append(f"--to hf:{out} exists and is not an empty directory; plait never "
                        "overwrites a model: choose a new directory")
    parent = next((p for p in out.parents if p.exists()), Path("."))
    if not parent.is_dir():
        problems.append(f"--to hf:{out}: {parent} is a file, not a directory")
    elif not os.access(parent, os.W_OK | os.X_OK):
        problems.append(f"--to hf:{out}: {parent} is not writable")
    return problems


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


def export(source: str, target: str, dtype: str = "fp32") -> tuple[Path, int]:
    """Write `source` (hf:DIR or a checkpoint) as the Hugging Face directory `target`
    (hf:OUT); returns (OUT, tensors written)."""
    problems = export_problems(target, dtype)
    if problems:
        raise CheckpointError("; ".join(problems))
    out = _out_dir(target)
    src = Source(source)
    m = src.model
    names = hf.weight_names(m)
    last: dict[str, torch.Tensor] = {}  # a stacked expert weight, read once for its rows

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

    # every Hugging Face tensor: a stacked expert weight is one a row (DeepSeek's names)
    tensors = {t: s for theirs, shape in names.values()
               for t, s in hf_deepseek.per_expert(theirs, shape)}
    by_hf = {t: (ours, (e if "{}" in theirs else None)) for ours, (theirs, shape)
             in names.items()
             for e, (t, _) in enumerate(hf_deepseek.per_expert(theirs, shape))}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        write_safetensors(tmp / "model.safetensors", tensors, load,
                          dtype, {"format": "pt", "plait_source": src.describe})
        (tmp / "config.json").write_text(json.dumps(_config(src, dtype), indent=2) + "\n")
        if src.origin is not None:
            for name in TOKENIZER_FILES:
                if (src.origin / name).is_file():
                    shutil.copyfile(src.origin / name, tmp / name)
        elif src.tokenizer_json is not None:
            shutil.copyfile(src.tokenizer_json, tmp / "tokenizer.json")
        if out.exists():
            out.rmdir()  # empty (checked): the rename takes its place
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out, len(tensors)
