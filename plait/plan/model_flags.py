"""`plait plan`'s model flags: a preset (`--model`), explicit shapes, or a preset with
some of its fields replaced; the block (`--arch llama|gpt`) and the MoE fields.

The runtime (plait/model/transformer.py) builds only the llama block (RMSNorm, GQA with
RoPE, SwiGLU, no biases; optionally MoE). `--arch gpt` (LayerNorm, GeLU MLP of width
--ffn, 4 x hidden by default, biases, dropout, the score matrix materialised) is a block
the planner models and `plait train` cannot run: `RUNTIME_NOTE` is what the plan says.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from plait.model.presets import PRESETS
from plait.plan.shape import Shape, from_preset

ARCHS = ("llama", "gpt")

# the explicit model shape flags: what each one is
SHAPE_HELP = {"layers": "transformer blocks", "hidden": "model width", "heads": "attention "
              "heads", "kv-heads": "key/value heads (GQA; default: --heads)", "ffn": "MLP "
              "width (default: 4 x --hidden)", "vocab": "vocabulary",
              "seq": "sequence length (default: the preset's max_seq_len; plait train's "
              "--seq-len defaults to 64)",
              "experts": "MoE routed experts (default 0: dense)", "top-k": "experts per "
              "token", "expert-ffn": "expert MLP width", "shared-experts": "always-active "
              "experts", "dense-layers": "MoE: the first N layers keep a dense MLP of width "
              "--ffn (DeepSeek-V3: 3)"}
# plait train's name for a flag, given first (the planner's older name stays an alias)
TRAIN_NAMES = {"seq": "seq-len"}
# flag -> Shape field
_FIELDS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "kv-heads": "kv_heads",
           "ffn": "ffn", "vocab": "vocab", "seq": "seq", "experts": "experts",
           "top-k": "top_k", "expert-ffn": "expert_ffn", "shared-experts": "shared_experts",
           "dense-layers": "dense_layers"}

RUNTIME_NOTE = ("note: --arch gpt is a block plait's runtime does not build "
                "(plait/model/transformer.py is the llama block only): this plan describes "
                "a model `plait train` cannot run, and --emit-config refuses it.")


class ShapeError(ValueError):
    """The model flags do not describe a model; the message names the fix."""


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (a preset, explicit shapes, or a preset with some "
                             "shapes replaced)")
    m.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    m.add_argument("--arch", choices=ARCHS, default=None,
                   help="block: llama (RMSNorm, GQA + RoPE, SwiGLU, no biases: the block "
                   "plait trains; default) or gpt (LayerNorm, GeLU MLP of --ffn, 4h by "
                   "default, biases; planned only, the runtime does not build it)")
    for flag, what in SHAPE_HELP.items():
        names = [f"--{TRAIN_NAMES[flag]}"] if flag in TRAIN_NAMES else []
        m.add_argument(*names, f"--{flag}", dest=flag.replace("-", "_"), type=int,
                       metavar="N", help=what)


def _given(args: argparse.Namespace) -> dict[str, int]:
    return {field: getattr(args, flag.replace("-", "_")) for flag, field in _FIELDS.items()
            if getattr(args, flag.replace("-", "_"), None) is not None}


def shape_from_args(args: argparse.Namespace) -> Shape:
    """The model: --model's preset with every given shape flag replacing its field, or the
    explicit shape flags alone; then --arch. Raises ShapeError naming the fix."""
    given = _given(args)
    arch = args.arch or "llama"
    if args.model:
        shape = from_preset(args.model)
        if arch == "gpt" and "ffn" not in given:
            given["ffn"] = 4 * given.get("hidden", shape.hidden)  # the preset's is SwiGLU's
        shape = replace(shape, arch=arch, **given)
        if given.keys() - {"seq"}:
            shape = replace(shape, name=f"{args.model} (modified)")
    else:
        need = [f for f in ("layers", "hidden", "heads", "vocab", "seq") if f not in given]
        if need:
            raise ShapeError(f"give --model (one of: {', '.join(PRESETS)}) or all of "
                             + ", ".join(f"--{TRAIN_NAMES.get(f, f)}" for f in need))
        h = given["hidden"]
        shape = Shape(given["layers"], h, given["heads"], given.get("kv_heads", given["heads"]),
                      given.get("ffn", 4 * h), given["vocab"], given["seq"], arch=arch,
                      name=f"custom {arch}",
                      **{k: given[k] for k in ("experts", "top_k", "expert_ffn",
                                               "shared_experts", "dense_layers") if k in given})
    check_shape(shape)
    return shape


def check_shape(shape: Shape) -> None:
    problems = shape_problems(shape)
    if problems:
        raise ShapeError("; ".join(problems))


def shape_problems(shape: Shape) -> list[str]:
    out: list[str] = []
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        out.append(f"hidden {shape.hidden} must be a multiple of heads {shape.heads}, and "
                   f"heads a multiple of kv-heads {shape.kv_heads}")
    if shape.moe and not (shape.top_k and shape.expert_ffn):
        out.append("an MoE model (--experts) needs --top-k and --expert-ffn")
    if shape.top_k > shape.experts:
        out.append(f"--top-k {shape.top_k} is more than the {shape.experts} experts: give "
                   "--experts >= --top-k (or --experts for an MoE model)")
    if shape.moe and shape.arch == "gpt":
        out.append("MoE is modelled in the llama block only: drop --arch gpt or --experts")
    if shape.dense_layers and not shape.moe:
        out.append("--dense-layers is for an MoE model (give --experts too), or leave it out")
    if shape.dense_layers >= shape.layers:
        out.append(f"--dense-layers {shape.dense_layers} must be < --layers {shape.layers} "
                   "(an MoE model keeps at least one MoE layer)")
    return out


def describe(shape: Shape) -> dict[str, Any]:
    """The shape as the plan's JSON gives it (with multi-head latent attention, its
    widths too)."""
    mla = {"attention": "mla", "q_lora_rank": shape.q_lora, "kv_lora_rank": shape.kv_lora,
           "qk_nope_head_dim": shape.qk_nope, "qk_rope_head_dim": shape.qk_rope,
           "v_head_dim": shape.v_head} if shape.mla else {}
    return mla | {"arch": shape.arch, "layers": shape.layers, "hidden": shape.hidden,
            "heads": shape.heads, "kv_heads": shape.kv_heads, "ffn": shape.ffn,
            "vocab": shape.vocab, "seq": shape.seq, "experts": shape.experts,
            "top_k": shape.top_k, "expert_ffn": shape.expert_ffn,
            "shared_experts": shape.shared_experts, "dense_layers": shape.dense_layers,
            "trainable_by_plait": shape.arch == "llama"}
