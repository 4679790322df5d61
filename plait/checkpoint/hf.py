"""Hugging Face Llama-family models in: config.json -> ModelConfig, weights -> this rank's
slices (docs/huggingface.md).

Supported: `model_type` llama (Llama 2 and 3, Llama 3.1's "llama3" RoPE scaling),
mistral without a sliding window, and deepseek_v3 (multi-head latent attention, the
first layers dense, the rest MoE: its config and names are plait/checkpoint/hf_deepseek.py).
Refused, naming the field: biases (Qwen2's q/k/v,
`attention_bias`, `mlp_bias`), an activation other than silu (SwiGLU), a head_dim other
than hidden_size / num_attention_heads, partial rotary, other RoPE scalings.

Names: `model.layers.i.self_attn.q_proj.weight` is plait's `layers.i.attn.wq.weight`, and
so on (`weight_names`). RoPE: Hugging Face rotates the halves (x_i, x_{i+d/2}) of each
head (its `rotate_half`), plait's `apply_rope` the interleaved pairs (x_{2i}, x_{2i+1}),
both with frequency i. Permuting the rows of wq and wk within each head (plait row 2i =
HF row i, plait row 2i+1 = HF row i + d/2) makes plait's q, k the same features in
another order; q.k sums over all of them, so the scores, and the model, are unchanged.

Loading reuses the checkpoint reader's view of a rank (`pieces`: each parameter's
tensor-parallel box and ZeRO flat run): each rank reads only those rows (and columns)
with safetensors' `get_slice`, never the whole model. `safetensors` is imported here only,
when a Hugging Face directory is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from plait.mesh import ParallelMesh
from plait.model.presets import ModelConfig
from plait.parallel.parallelize import ParallelModel

from . import hf_deepseek
from .format import CheckpointError
from .pieces import Piece, covering_box, cut, initial_pieces

HF_PREFIX = "hf:"
SUPPORTED = ("llama", "mistral", hf_deepseek.MODEL_TYPE)
# tensors some checkpoints carry that plait derives (RoPE frequencies): ignored
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFError(CheckpointError):
    """A Hugging Face directory plait cannot read or represent; the message names why."""


def source_dir(source: str | None, prefix: str) -> Path | None:
    """The directory of a `PREFIX:DIR` source (hf:, dcp:), None for anything else."""
    if source is None or not str(source).startswith(prefix):
        return None
    return Path(str(source)[len(prefix):]).expanduser()


def hf_dir(source: str | None) -> Path | None:
    """The directory of an `hf:DIR` source, None for anything else."""
    return source_dir(source, HF_PREFIX)


def read_config_json(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise HFError(f"hf:{directory}: no such directory")
    if not path.is_file():
        raise HFError(f"hf:{directory}: no config.json, not a Hugging Face model directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFError(f"{path} holds {type(data).__name__}, not a model config")
    return data


def _rope(c: dict, path: Path) -> dict:
    """theta and Llama 3 scaling from `rope_parameters` (transformers 5) or `rope_theta` +
    `rope_scaling` (transformers 4)."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise HFError(f"{path}: rope_parameters / rope_scaling must be objects")
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    theta = merged.get("rope_theta", c.get("rope_theta", 10000.0))
    partial = merged.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFError(f"{path}: partial_rotary_factor={partial}: plait rotates the whole "
                      "head (partial rotary cannot be represented)")
    out = {"rope_theta": float(theta)}
    if kind == "llama3":
        try:
            out.update(rope_scaling_factor=float(merged["factor"]),
                       rope_low_freq_factor=float(merged["low_freq_factor"]),
                       rope_high_freq_factor=float(merged["high_freq_factor"]),
                       rope_original_max_len=int(merged["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as e:
            raise HFError(f"{path}: llama3 rope scaling without a usable {e}") from None
    elif kind not in ("default", None):
        raise HFError(f"{path}: rope_type={kind!r}: plait supports the default RoPE and "
                      "Llama 3's 'llama3' scaling only")
    return out


def _refusals(c: dict, path: Path) -> None:
    kind = c.get("model_type")
    if kind == "qwen2":
        raise HFError(f"{path}: model_type 'qwen2' has q/k/v projection biases, which "
                      "plait's block cannot represent (no biases); supported: "
                      + ", ".join(SUPPORTED))
    if kind not in SUPPORTED:
        raise HFError(f"{path}: model_type {kind!r} is not a Llama-family model plait can "
                      "read; supported: " + ", ".join(SUPPORTED))
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise HFError(f"{path}: {flag}=true: plait's block has no biases")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"{path}: hidden_act={act!r}: plait's MLP is SwiGLU (silu)")
    window = c.get("sliding_window")
    if window is not None and window < c.get("max_position_embeddings", 0):
        raise HFError(f"{path}: sliding_window={window}: plait's attention is full causal "
                      "attention (no sliding window)")


def model_config(directory: Path) -> ModelConfig:
    """The plait model of a Hugging Face directory's config.json; HFError naming the field
    plait's block cannot represent."""
    path = Path(directory) / "config.json"
    c = read_config_json(directory)
    if c.get("model_type") == hf_deepseek.MODEL_TYPE:
        return hf_deepseek.model_config(c, path)
    _refusals(c, path)
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
    for key in need + ("num_key_value_heads", "max_position_embeddings", "head_dim"):
        v = c.get(key)
        if key in need and v is None:
            raise HFError(f"{path}: no {key}")
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise HFError(f"{path}: {key}={v!r} must be a positive integer")
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    dim = c["hidden_size"]
    if dim % heads:
        raise HFError(f"{path}: hidden_size={dim} is not a multiple of num_attention_heads"
                      f"={heads}")
    head_dim = c.get("head_dim") or dim // heads
    if head_dim != dim // heads or head_dim % 2:
        raise HFError(f"{path}: head_dim={head_dim}: plait's heads are hidden_size / "
                      f"num_attention_heads = {dim // heads} wide, and even")
    if heads % kv:
        raise HFError(f"{path}: num_key_value_heads={kv} does not divide "
                      f"num_attention_heads={heads}")
    return ModelConfig(vocab_size=c["vocab_size"], dim=dim, n_layers=c["num_hidden_layers"],
                       n_heads=heads, n_kv_heads=kv, ffn_dim=c["intermediate_size"],
                       max_seq_len=c.get("max_position_embeddings") or 2048,
                       norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                       init_std=float(c.get("initializer_range", 0.02)), **_rope(c, path))


_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
          "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
          "mlp_norm.weight": "post_attention_layernorm.weight",
          "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
          "mlp.w2.weight": "mlp.down_proj.weight"}


def weight_names(m: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """plait parameter name -> (Hugging Face tensor name, shape), in the model's order."""
    if m.mla:
        return hf_deepseek.weight_names(m)
    kv, d = m.n_kv_heads * m.head_dim, m.dim
    shapes = {"attn_norm.weight": (d,), "attn.wq.weight": (d, d), "attn.wk.weight": (kv, d),
              "attn.wv.weight": (kv, d), "attn.wo.weight": (d, d), "mlp_norm.weight": (d,),
              "mlp.w1.weight": (m.ffn_dim, d), "mlp.w3.weight": (m.ffn_dim, d),
              "mlp.w2.weight": (d, m.ffn_dim)}
    out = {"embed.weight": ("model.embed_tokens.weight", (m.vocab_size, d))}
    for i in range(m.n_layers):
        for ours, theirs in _LAYER.items():
            out[f"layers.{i}.{ours}"] = (f"model.layers.{i}.{theirs}", shapes[ours])
    out["norm.weight"] = ("model.norm.weight", (d,))
    if not m.tie_embeddings:
        out["head.weight"] = ("lm_head.weight", (m.vocab_size, d))
    return out


def rope_permutation(n_heads: int, head_dim: int) -> torch.Tensor:
    """P with plait_rows = hf_rows[P] for wq (n_heads) or wk (n_kv_heads): within each
    head, plait row 2i is HF row i and plait row 2i+1 is HF row i + head_dim/2."""
    half = head_dim // 2
    i = torch.arange(half, device="cpu")
    within = torch.stack((i, i + half), dim=1).reshape(-1)
    return (torch.arange(n_heads, device="cpu")[:, None] * head_dim + within).reshape(-1)


def row_permutation(name: str, m: ModelConfig) -> torch.Tensor | None:
    """The RoPE row permutation of parameter `name`, None if its rows keep their order
    (DeepSeek's interleaved RoPE features are plait's order already)."""
    if m.mla:
        return None
    if name.endswith("attn.wq.weight"):
        return rope_permutation(m.n_heads, m.head_dim)
    if name.endswith("attn.wk.weight"):
        return rope_permutation(m.n_kv_heads, m.head_dim)
    return None


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise HFError("reading Hugging Face weights needs the safetensors package "
                      "(pip install safetensors)") from None
    return safe_open


class HFWeights:
    """The tensors of a Hugging Face directory (model.safetensors, or shards listed in
    model.safetensors.index.json), read by slices in plait's names and row order."""

    def __init__(self, directory: Path, cfg: ModelConfig):
        self.dir, self.cfg = Path(directory), cfg
        self.names = weight_names(cfg)
        self._open: dict[str, object] = {}
        self.file_of = self._index()

    def _index(self) -> dict[str, str]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFError(f"{index}: not a safetensors index ({e})") from None
            return dict(wmap)
        single = self.dir / "model.safetensors"
        if single.is_file():
            return {n: single.name for n in self._file(single.name).keys()}
        other = sorted(p.name for p in self.dir.glob("*.bin")) + sorted(
            p.name for p in self.dir.glob("*.pt*"))
        hint = f" (found {', '.join(other[:3])}: plait reads safetensors only)" if other else ""
        raise HFError(f"hf:{self.dir}: no model.safetensors or model.safetensors.index.json"
                      f"{hint}")

    def _file(self, name: str):
        if name not in self._open:
            path = self.dir / name
            if not path.is_file():
                raise HFError(f"hf:{self.dir}: {name} (named by the index) is missing")
            try:
                self._open[name] = _safe_open()(str(path), framework="pt", device="cpu")
            except HFError:
                raise
            except Exception as e:  # safetensors raises its own untyped errors
                raise HFError(f"{path}: not a readable safetensors file ({e})") from None
        return self._open[name]

    def _slice(self, hf_name: str):
        return self._file(self.file_of[hf_name]).get_slice(hf_name)

    def check(self) -> None:
        """Every tensor the config implies is there with its shape; nothing plait cannot
        represent (a bias, another layer) is: from the headers only."""
        problems = []
        every = [t for name, shape in self.names.values()
                 for t in hf_deepseek.per_expert(name, shape)]
        for hf_name, shape in every:
            if hf_name not in self.file_of:
                problems.append(f"{hf_name} is missing")
                continue
            found = tuple(self._slice(hf_name).get_shape())
            if found != shape:
                problems.append(f"{hf_name} is {list(found)} in the files, config.json "
                                f"implies {list(shape)}")
        known = {n for n, _ in every} | {"lm_head.weight"}
        extra = sorted(n for n in self.file_of if n not in known
                       and not n.endswith(IGNORED_SUFFIXES)
                       and not (self.cfg.mla and hf_deepseek.beyond_the_layers(n, self.cfg)))
        if extra:
            problems.append(f"tensors plait's block has no place for: {', '.join(extra[:4])}"
                            + (f" and {len(extra) - 4} more" if len(extra) > 4 else ""))
        if problems:
            raise HFError(f"hf:{self.dir}: the weights disagree with config.json: "
                          + "; ".join(problems[:6]))

    def rows(self, name: str, lo: int, hi: int, cols: tuple[int, int] | None = None
             ) -> torch.Tensor:
        """Rows [lo, hi) (plait's order) of plait parameter `name`, fp32; `cols`: [a, b)
        of the second axis only."""
        if name == "head.weight" and self.cfg.tie_embeddings:
            name = "embed.weight"
        if "{}" in self.names[name][0]:  # a stacked expert weight: rows are experts
            return torch.stack([self._slice(self.names[name][0].format(e))[:].float()
                                for e in range(lo, hi)])
        sl = self._slice(self.names[name][0])
        perm = row_permutation(name, self.cfg)
        idx = None
        if perm is not None:
            idx = perm[lo:hi]
            lo, hi = int(idx.min()), int(idx.max()) + 1
        block = sl[lo:hi] if cols is None else sl[lo:hi, cols[0]:cols[1]]
        block = block.float()
        return block if idx is None else block[idx - lo]

    def full(self, name: str) -> torch.Tensor:
        """The whole of plait parameter `name` (fp32, plait's row order)."""
        shape = self.names["embed.weight" if name == "head.weight" else name][1]
        return self.rows(name, 0, shape[0])

    def read(self, p: Piece) -> torch.Tensor:
        """Piece `p`'s elements (flat, fp32): the rows covering them, the box's columns
        only."""
        offset, shape, skip = covering_box(p)
        cols = (offset[1], offset[1] + shape[1]) if len(shape) == 2 else None
        return cut(self.rows(p.name, offset[0], offset[0] + shape[0], cols), p, skip)


def load_into(par: ParallelModel, mesh: ParallelMesh, cfg, directory: Path) -> int:
    """Fill this rank's part of `par` (its masters, and the compute parameters where they
    are read directly) from a Hugging Face directory; returns the elements read. No
    collective: every rank reads its own slices. The optimizer starts fresh (step 0)."""
    weights = HFWeights(directory, cfg.model)
    weights.check()
    read = 0
    with torch.no_grad():
        for p in initial_pieces(par, mesh, cfg.train.optimizer):
            flat = weights.read(p)
            p.tensor.copy_(flat.reshape(p.tensor.shape))
            read += flat.numel()
    par.optimizer.finish_load(0)
    return read
