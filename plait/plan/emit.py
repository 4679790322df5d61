"""`plait plan --emit-config run.toml`: the chosen layout as a config `plait train` runs.

The config is built as a plait `Config` and validated for its world size (the product of
the axes' sizes) with the same `validate()` `plait train` runs, so a file this writes is one
`plait train --config run.toml --nproc N` (or torchrun with N ranks) accepts. Beside it,
`run.plan.json` holds the plan of that layout (the `plait plan --json` entry, the
hardware it was planned for, goodput when asked): `plait report --metrics m.jsonl --plan
run.plan.json` compares the run against it (plait/observe/plan_check.py).

Mapping (planner -> runtime), stated in the file's header:
- recompute: the same mode (none, selective, full mean the same in both: the planner's
  selective with flash attention is the runtime's list, plait/plan/shape.py
  selective_terms); a plan with `--attention math` is refused (plait's SDPA attention keeps
  no probabilities: plan it with flash);
- precision: bf16 -> bf16 (fp32 masters and moments), fp32 -> fp32, bf16-fp32grad -> bf16
  (the runtime keeps gradients in the compute dtype: docs/architecture.md, Decisions);
- optimizer: adam -> adamw; sgd -> sgd (the runtime's is plain, no momentum);
- the search's layouts, best first: the first one the runtime builds is written; those
  it skips are named with the reason.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from plait.config import Config, ParallelConfig, TrainConfig
from plait.config.overlap_checks import PAIRING_SCHEDULES
from plait.dims import DIMENSIONS
from plait.files import atomic_output
from plait.model.presets import PRESETS, ModelConfig
from plait.plan.activations import RUNTIME_ATTENTION
from plait.plan.estimate import Estimate, Training
from plait.plan.hardware import Cluster
from plait.plan.search import PlanError
from plait.plan.shape import Shape
from plait.schedule.registry import schedule_spec

_PRECISION = {"bf16": "bf16", "fp32": "fp32", "bf16-fp32grad": "bf16", "fp8": "fp8"}
_OPTIMIZER = {"adam": "adamw", "sgd": "sgd"}


def plan_path(config_path: str) -> str:
    """Where the plan beside `config_path` goes: run.toml -> run.plan.json."""
    stem = config_path[:-5] if config_path.endswith(".toml") else config_path
    return stem + ".plan.json"


def _model(shape: Shape, preset: str | None) -> tuple[str, ModelConfig]:
    base = PRESETS[preset] if preset in PRESETS else PRESETS["tiny"]
    model = dataclasses.replace(
        base, vocab_size=shape.vocab, dim=shape.hidden, n_layers=shape.layers,
        n_heads=shape.heads, n_kv_heads=shape.kv_heads, ffn_dim=shape.ffn,
        max_seq_len=max(base.max_seq_len, shape.seq), n_experts=shape.experts,
        top_k=shape.top_k, expert_ffn_dim=shape.expert_ffn,
        n_shared_experts=shape.shared_experts, n_dense_layers=shape.dense_layers,
        tie_embeddings=shape.tie_embeddings)
    return (preset if preset in PRESETS else "tiny"), model


def layout_config(est: Estimate, shape: Shape, cluster: Cluster, train: Training,
                  preset: str | None) -> Config:
    """The plait Config of one planned layout (scalar fields)."""
    lay = est.layout
    name, model = _model(shape, preset)
    pp = int(lay.pp)
    spec = schedule_spec(lay.schedule)
    par = ParallelConfig(
        **{d.name: int(lay.sizes[d.name]) for d in DIMENSIONS}, zero=int(lay.zero),
        sp=bool(lay.sp) and int(lay.tp) > 1, cp_mode=lay.cp_mode,
        async_tp=bool(lay.async_tp) and bool(lay.sp) and int(lay.tp) > 1,
        overlap_fb=bool(lay.overlap_fb) and pp > 1 and lay.schedule in PAIRING_SCHEDULES,
        schedule=lay.schedule if pp > 1 else "1f1b",
        virtual_stages=int(lay.v) if pp > 1 and spec.free_virtual_stages else None,
        microbatches=int(est.microbatches), gpus_per_node=cluster.gpus_per_node,
        order=tuple(lay.order))
    tc = TrainConfig(global_batch=train.global_batch, seq_len=shape.seq,
                     precision=_PRECISION[train.precision],
                     optimizer=_OPTIMIZER[train.optimizer],
                     recompute=lay.recompute)
    return Config(model=model, parallel=par, train=tc, model_name=name)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a TOML basic string: JSON's escapes are TOML's


# written whatever the defaults are, so the file keeps its layout if a default changes
_ALWAYS = {"model": {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                     "max_seq_len"},
           "parallel": {*(d.name for d in DIMENSIONS), "zero", "sp", "schedule",
                        "microbatches"},
           "train": {"global_batch", "seq_len", "precision", "optimizer", "recompute"}}


def config_toml(cfg: Config, header: list[str]) -> str:
    """The config as TOML: the preset, the layout's fields, then every other field that
    differs from the defaults that preset gives (None fields left out: TOML has no null)."""
    lines = [f"# {h}" for h in header] + ["", f"model_name = {_toml_value(cfg.model_name)}"]
    base = Config(model=PRESETS[cfg.model_name])
    for section in ("model", "parallel", "train"):
        ours, default = getattr(cfg, section), getattr(base, section)
        rows = [f"{f.name} = {_toml_value(getattr(ours, f.name))}"
                for f in dataclasses.fields(ours)
                if getattr(ours, f.name) is not None
                and (f.name in _ALWAYS[section]
                     or getattr(ours, f.name) != getattr(default, f.name))]
        if rows:
            lines += ["", f"[{section}]", *rows]
    return "\n".join(lines) + "\n"


def choose_runnable(ests: list[Estimate], shape: Shape, cluster: Cluster, train: Training,
                    preset: str | None) -> tuple[Estimate, Config, list[str]]:
    """The first layout (best first) whose config validates for its world size; the
    reasons the ones before it were skipped. PlanError when none does."""
    if shape.arch != "llama":
        raise PlanError("--emit-config: plait's runtime builds the llama block only "
                        "(plait/model/transformer.py); this plan is for --arch "
                        f"{shape.arch}. Drop --emit-config, or plan --arch llama")
    if any(e.layout.attention != RUNTIME_ATTENTION for e in ests):
        raise PlanError("--emit-config: plait's runtime attention is SDPA, the flash "
                        "kernel's tensors (output + log-sum-exp, no probabilities); this "
                        "plan assumes --attention math. Drop --emit-config, or plan with "
                        "--attention flash")
    skipped: list[str] = []
    for k, est in enumerate(ests, 1):
        cfg = layout_config(est, shape, cluster, train, preset)
        problems = cfg.validate(cfg.parallel.world_size)
        if not problems:
            return est, cfg, skipped
        skipped.append(f"layout #{k} ({est.layout.label()}, ZeRO-{est.layout.zero}, "
                       f"{est.layout.schedule}): {'; '.join(problems)}")
    hint = ("change the --layout" if len(ests) == 1 else
            "show more with --top, or give one with --layout")
    raise PlanError("--emit-config: plait train cannot run any layout shown:\n"
                    + "\n".join(f"  - {s}" for s in skipped) + f"\n  {hint}")


def write_config(path: str, cfg: Config, header: list[str], plan_doc: dict[str, Any]) -> str:
    """Write the TOML and the plan beside it, each whole or not at all; the plan's path."""
    side = plan_path(path)
    with atomic_output(side) as tmp:
        tmp.write_text(json.dumps(plan_doc, indent=1) + "\n")
    with atomic_output(path) as tmp:
        tmp.write_text(config_toml(cfg, header))
    return side


def emit_plan(args: Any, ests: list[Estimate], gps: list[dict] | None, shape: Shape,
              cluster: Cluster, train: Training, layout_dict: Any) -> list[str]:
    """Write --emit-config and its plan (`layout_dict`: the plan's JSON entry of a layout);
    the lines that say what was written."""
    from plait.plan.model_flags import describe

    est, cfg, skipped = choose_runnable(ests, shape, cluster, train, args.model)
    k = ests.index(est)
    n = cfg.parallel.world_size
    g = cluster.gpu
    plan_doc = {"model": shape.name, "shape": describe(shape), "gpus": cluster.n_gpus,
                "hardware": {"gpu": g.name, "peak_flops": g.peak_flops,
                             "hbm_bytes": g.hbm_bytes, "hbm_bw": g.hbm_bw,
                             "nvlink_bw": g.nvlink_bw, "internode_bw": g.internode_bw,
                             "gpus_per_node": g.gpus_per_node,
                             "profile": getattr(args, "hardware", None)},
                "global_batch": train.global_batch, "precision": train.precision,
                "optimizer": train.optimizer, "layout": layout_dict(est),
                "goodput": gps[k] if gps else None, "config": args.emit_config}
    header = [f"plait plan: {shape.name} on {n} x {g.name}, layout #{k + 1} "
              f"{est.layout.label()} ZeRO-{est.layout.zero} {est.layout.schedule} recompute "
              f"{est.layout.recompute}: predicted {float(est.step_time):.4g} s/step",
              f"run: plait train --config {args.emit_config} --nproc {n}   (or torchrun "
              f"with {n} ranks); compare: plait report --metrics M.jsonl --plan "
              f"{plan_path(args.emit_config)}",
              "mapping: recompute as planned (flash attention: SDPA's); bf16-fp32grad -> "
              "bf16; adam -> adamw (see plait/plan/emit.py)"]
    side = write_config(args.emit_config, cfg, header, plan_doc)
    lines = [f"config for layout #{k + 1} written to {args.emit_config} (plan: {side}); "
             f"run it with plait train --config {args.emit_config} --nproc {n}"]
    return lines + [f"not emitted: {s}" for s in skipped]
