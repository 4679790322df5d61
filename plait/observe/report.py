"""`plait report`: predicted vs measured, for one training run's metrics file.

    plait train --nproc 2 --dp 2 --set train.memory_step=1 --metrics-out m.jsonl
    plait report --metrics m.jsonl [--config run.toml | the same train flags] [--json]

Memory: the step `train.memory_step` of the metrics file carries the lead rank's (rank 0's)
measured peak by category (plait/device/memory.py); it is compared with the planner's
prediction for that rank, `plait.plan.runtime_memory.predicted_rank_memory`
(kernels="eager": plait's CPU runtime; one cost model, the code `plait plan` uses; the
dry run prints the same function's). Communication: the summary's
ledger (payload bytes per step per collective@dim, rank 0) beside the planner's
collectives of the same rank (`plait.plan.rank_collectives` for pipeline rank 0: payload
per call × calls per step), per mesh dim. The configuration comes from the summary line
(`plait train` writes it there), or from --config / train flags when given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from plait.config import Config, ConfigError, ParallelConfig, TrainConfig
from plait.model.presets import ModelConfig

# tracker category -> planner categories
MEMORY_CATEGORIES = {"params": ("parameters",), "grads": ("gradients",),
                     "optimizer": ("optimizer states",), "comm": ("communication buffers",),
                     "activations": ("activations", "logits")}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from plait.cli_parser import copy_flags
    from plait.train.flags import add_config_args

    p = subparsers.add_parser("report", help="predicted vs measured memory and communication "
                              "for a metrics file", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", required=True, help="JSON lines written by plait train "
                   "--metrics-out (with --set train.memory_step=N for memory)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--html", metavar="FILE", help="also write the run as one self-contained "
                   "HTML page (configuration, curves, memory, communication, overlap, "
                   "pipeline; no network needed to view it; needs matplotlib)")
    p.add_argument("--png-dir", metavar="DIR", help="also write the same figures as PNG "
                   "files in DIR (needs matplotlib)")
    p.add_argument("--force", action="store_true", help="replace an existing --html page "
                   "(by default plait refuses to)")
    p.add_argument("--plan", metavar="RUN.plan.json",
                   help="also compare against this plan (written by plait plan "
                   "--emit-config): layout, step time, bytes per dim")
    p.add_argument("--override-config", action="store_true",
                   help="report against the configuration of --config / the flags given "
                   "here instead of the one the metrics file records")
    # for a metrics file that records no configuration: --config / --set, or the run's
    # own train flags (accepted, not listed: plait train --help lists them)
    settings = [a.option_strings[0] for a in _scratch(add_config_args)._actions]
    copy_flags(p, add_config_args, ("--config", "--set"), hidden=settings, helps={
        "--config": "the run's TOML config, for a metrics file that records none (the "
        "run's plait train setting flags, --dp, --pp, --model ..., are taken too)"})
    p.set_defaults(func=run)
    return p


def _scratch(adder: Any) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    adder(p)
    return p


def config_from_dict(d: dict) -> Config:
    par = dict(d["parallel"])
    par["order"] = tuple(par.get("order", ()))  # JSON made it a list
    return Config(model=ModelConfig(**d["model"]), parallel=ParallelConfig(**par),
                  train=TrainConfig(**d["train"]), model_name=d.get("model_name", "custom"))


def read_metrics(path: str | Path) -> tuple[list[dict], dict]:
    """The step rows and the summary of a metrics file; ValueError names what is wrong."""
    path = Path(path)
    if path.is_dir():
        raise ValueError("is a directory; give the file plait train --metrics-out wrote")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError("is binary, not a metrics file (JSON lines from plait train "
                         "--metrics-out)") from None
    rows, summary = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number} is not JSON ({e.msg}); give the file plait train "
                             "--metrics-out wrote") from None
        if not isinstance(row, dict) or not ("summary" in row or "step" in row):
            raise ValueError(f"line {number} is not a metrics row (no 'step' or 'summary')")
        if row.get("summary"):
            summary = row
        else:
            rows.append(row)
    return rows, summary


def _flags_given(args: argparse.Namespace) -> bool:
    from plait.train.flags import TRAIN_FLAGS

    return bool(args.config or args.set or any(getattr(args, f, None) is not None
                                                 for f in TRAIN_FLAGS))


def compare(rows: list[dict], summary: dict, cfg: Config) -> dict:
    """The comparison as data: memory by category, communication by collective and dim."""
    from plait.plan import rank_collectives
    from plait.plan.runtime_memory import predicted_rank_memory
    from plait.plan.runtime_memory_sizes import token_file_windows

    out: dict[str, Any] = {"layout": summary.get("layout"), "memory": None,
                           "communication": None, "notes": []}
    mem_row = next((r for r in rows if "memory" in r), None)
    # the metrics file is rank 0's (pp rank 0); the run's loader read cfg.train.data
    pred = predicted_rank_memory(cfg, 0, token_file_windows(cfg))
    if mem_row is None:
        out["memory_missing"] = "no measured memory: train with --set train.memory_step=N"
        out["notes"].append(out["memory_missing"])
    elif "not_covered" in pred:
        out["memory_missing"] = f"no memory prediction: {pred['not_covered']}"
        out["notes"].append(out["memory_missing"])
    else:
        measured, peak_total = mem_row["memory"]["peak"], mem_row["memory"]["peak_total"]
        cats = []
        for cat, names in MEMORY_CATEGORIES.items():
            p = float(sum(pred[n] for n in names))
            cats.append({"category": cat, "predicted": p, "measured": measured[cat],
                         "ratio": p / measured[cat] if measured[cat] else None})
        cats.append({"category": "total (peak)", "predicted": pred["total"],
                     "measured": peak_total, "ratio": pred["total"] / peak_total})
        out["memory"] = {"step": mem_row["step"], "rank": 0, "moment": pred["moment"],
                         "categories": cats}
    ledger = summary.get("ledger", {}).get("per_step", {})
    # the ledger is rank 0's, the first pipeline rank: the planner's collectives of that
    # rank, not of the layout's most loaded one (a middle rank sends both ways: 2x at pp >= 3)
    collectives = rank_collectives(cfg, 0)
    predicted: dict[str, list[dict]] = {}
    for c in collectives:
        predicted.setdefault(c.dim, []).append(
            {"op": c.op, "bytes_per_call": float(c.size), "calls": float(c.count),
             "bytes_per_step": float(c.size * c.count)})
    measured_by_dim: dict[str, list[dict]] = {}
    for key, row in sorted(ledger.items()):
        op, dim = key.split("@")
        measured_by_dim.setdefault(dim, []).append(
            {"op": op, "calls": row["count"], "bytes_per_step": row["payload"]})
    dims = []
    overlap = summary.get("ledger", {}).get("overlap_per_step", {})
    for dim in sorted(set(predicted) | set(measured_by_dim)):
        p = sum(x["bytes_per_step"] for x in predicted.get(dim, []))
        # like for like: the planner counts a point-to-point transfer once, at its sender
        # (pipeline sends, context parallel's ring hops); the ledger also records it at the
        # receiver, whose bytes are a peer's sends (listed, not summed)
        m = sum(x["bytes_per_step"] for x in measured_by_dim.get(dim, []) if x["op"] != "recv")
        dims.append({"dim": dim, "predicted": predicted.get(dim, []),
                     "measured": measured_by_dim.get(dim, []), "predicted_bytes": p,
                     "measured_bytes": m, "ratio": p / m if m and p else None,
                     **_exposure(dim, collectives, overlap.get(dim))})
    out["communication"] = dims
    out["step_time_s"] = summary.get("mean_step_time")
    # the held-out loss after the steps that computed one (plait train --eval-every)
    out["validation"] = [{k: r[k] for k in ("step", "val_loss", "val_perplexity")}
                         for r in rows if "val_loss" in r]
    out["stragglers"] = stragglers(rows, summary, cfg.parallel.gpus_per_node)
    if not ledger:
        out["notes"].append("the summary line has no ledger")
    out["notes"].append(
        "communication: the planner lists the collectives that move model data (gradients, "
        "parameters, activations); the ledger also counts the metrics and grad-norm "
        "all-reduces and the all-gather of every rank's step figures (dims world, and a "
        "few bytes on dp/pp), the embedding/loss "
        "collectives of tp, and sizes everything in the dtype actually sent")
    _explain_exposure(out, cfg)
    return out


def stragglers(rows: list[dict], summary: dict, gpus_per_node: int) -> dict | None:
    """Per rank, its node and mean compute and wait per step, and the ranks named
    (plait/train/stragglers.py); None for a metrics file that records no figures."""
    found = summary.get("stragglers")
    if not found or not found["compute_s_per_rank"]:
        return None
    ranks = [{"rank": r, "node": r // gpus_per_node, "compute_s": c, "wait_s": w}
             for r, (c, w) in enumerate(zip(found["compute_s_per_rank"],
                                            found["wait_s_per_rank"], strict=True))]
    steps = [r["step"] for r in rows if r.get("straggler")]
    return {"ranks": ranks, "named": found["named"], "rule": found["rule"],
            "steps_with_a_straggler": len(steps)}


def print_stragglers(console: Any, found: dict, shown: int = 16) -> None:
    """The ranks named, and a table of the slowest `shown` ranks by compute."""
    from rich.table import Table

    from plait.train.stragglers import straggler_text

    rule = found["rule"]
    console.print(f"stragglers (a rank's compute above {rule['relative']:g}x and "
                  f"{rule['absolute_s'] * 1e3:g} ms over its peers' median, {rule['steps']} "
                  "steps in a row; peers: " + rule["peers"] + "): "
                  + ("; ".join(f"{straggler_text(v)} (from step {v['first_step']})"
                               for v in found["named"]) or "none named"),
                  soft_wrap=True, highlight=False)
    ranks = sorted(found["ranks"], key=lambda r: -r["compute_s"])[:shown]
    t = Table(title=f"per rank, mean per step (the {len(ranks)} slowest by compute of "
              f"{len(found['ranks'])})")
    for col in ("rank", "node", "compute", "wait (in collectives)"):
        t.add_column(col, justify="right")
    for r in ranks:
        t.add_row(str(r["rank"]), str(r["node"]), f"{r['compute_s'] * 1e3:.1f} ms",
                  f"{r['wait_s'] * 1e3:.1f} ms")
    console.print(t)


def _explain_exposure(out: dict, cfg: Config) -> None:
    """A note on the dim whose measured exposed share differs most from the planner's."""
    from plait.dims import REPLICA_AXES, replica_group

    pairs = [(abs(d["measured_exposed_share"] - d["predicted_exposed_share"]), d)
             for d in out["communication"]
             if d["measured_exposed_share"] is not None
             and d["predicted_exposed_share"] is not None]
    if not pairs:
        return
    gap, d = max(pairs, key=lambda x: x[0])
    p = cfg.parallel
    replicas = replica_group({name: getattr(p, name) for name in REPLICA_AXES})
    if d["dim"] == replicas and p.zero == 0 and p.data_parallel == "naive":
        out["notes"].append(
            f"overlap: the largest difference is on {replicas}: measured exposed share "
            f"{d['measured_exposed_share']:.2f}, planner {d['predicted_exposed_share']:.2f}. "
            "The planner overlaps the gradient all-reduce with the last backward (bucketed "
            "data parallel); this run's naive data parallel all-reduces each gradient "
            "after backward, synchronously, so all of it is exposed")
        return
    out["notes"].append(
        f"overlap: the largest difference is on {d['dim']}: measured exposed share "
        f"{d['measured_exposed_share']:.2f}, planner {d['predicted_exposed_share']:.2f}. "
        "The planner hides a collective behind the compute its model schedules beside it "
        "on its GPU model; on CPU/gloo the same rank's cores run both, so an async "
        "collective progresses only while the rank is not computing and its wait exposes "
        "the rest")


def _exposure(dim: str, collectives: list, measured: dict | None) -> dict:
    """The share of a dim's communication time that is exposed (the rank waits for it),
    predicted by the planner and measured by the ledger. A share, not seconds: the
    planner's seconds are for its hardware model, the run's for this machine; the share
    says what overlaps with what on both."""
    own = [c for c in collectives if c.dim == dim]
    total = float(sum(c.total for c in own))
    predicted = float(sum(c.exposed for c in own)) / total if total > 0 else None
    out = {"predicted_exposed_share": predicted, "measured_seconds": None,
           "measured_exposed_s": None, "measured_hidden_s": None,
           "measured_exposed_share": None}
    if measured and measured["seconds"] > 0:
        out.update(measured_seconds=measured["seconds"], measured_exposed_s=measured["exposed"],
                   measured_hidden_s=measured["hidden"],
                   measured_exposed_share=measured["exposed"] / measured["seconds"])
    return out


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# the overlap table's columns (the terminal's and the HTML page's): the exposed time is
# what a step pays; the time in flight is summed over collectives, which overlap one
# another (a pipeline's sends), so it can exceed the step
OVERLAP_COLUMNS = ("dim", "exposed share: planner", "measured", "exposed ms",
                   "exposed, % of step", "in flight ms (summed)")


def overlap_rows(dims: list[dict], step_s: float | None) -> list[list[str]]:
    """One row per dim: OVERLAP_COLUMNS' values."""
    rows = []
    for d in dims:
        seen = d["measured_seconds"] is not None
        exposed = d["measured_exposed_s"] if seen else None
        rows.append([d["dim"], _share(d["predicted_exposed_share"]),
                     _share(d["measured_exposed_share"]),
                     f"{exposed * 1e3:.2f}" if seen else "-",
                     f"{100 * exposed / step_s:.1f} %" if seen and step_s else "-",
                     f"{d['measured_seconds'] * 1e3:.2f}" if seen else "-"])
    return rows


def overlap_title(step_s: float | None) -> str:
    step = f" (mean step {step_s * 1e3:.1f} ms)" if step_s else ""
    return (f"overlap per step, rank 0{step}: the share of each dim's communication time "
            "the rank waits for (exposed)")


def print_overlap(console: Any, dims: list[dict], step_s: float | None) -> None:
    """Exposed share of each dim's communication, planner vs ledger, with the seconds."""
    from rich.table import Table

    t = Table(title=overlap_title(step_s))
    for col in OVERLAP_COLUMNS:
        t.add_column(col, justify="left" if col == "dim" else "right")
    for row in overlap_rows(dims, step_s):
        t.add_row(*row)
    console.print(t)


def _fmt(n: float | None) -> str:
    from plait.train.progress import human_bytes

    return "-" if n is None else human_bytes(n)


def print_report(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if rep["memory"]:
        m = rep["memory"]
        t = Table(title=f"memory, rank 0, step {m['step']}: predicted (kernels=eager) vs "
                  f"measured peak - predicted peak moment: {m['moment']}")
        for col in ("category", "predicted", "measured", "predicted / measured"):
            t.add_column(col, justify="left" if col == "category" else "right")
        for c in m["categories"]:
            t.add_row(c["category"], _fmt(c["predicted"]), _fmt(c["measured"]),
                      "-" if c["ratio"] is None else f"{c['ratio']:.3f}")
        console.print(t)
    t = Table(title="communication per step, rank 0: planner vs ledger (payload bytes)")
    for col in ("dim", "planner: op x calls", "predicted", "ledger: op x calls", "measured",
                "ratio"):
        t.add_column(col, justify="right" if col in ("predicted", "measured", "ratio")
                     else "left")
    for d in rep["communication"]:
        t.add_row(d["dim"],
                  "\n".join(f"{x['op']} x{x['calls']:g}" for x in d["predicted"]) or "-",
                  _fmt(d["predicted_bytes"] or None),
                  "\n".join(f"{x['op']} x{x['calls']:g}" for x in d["measured"]) or "-",
                  _fmt(d["measured_bytes"] or None),
                  "-" if d["ratio"] is None else f"{d['ratio']:.3f}")
    console.print(t)
    print_overlap(console, rep["communication"], rep.get("step_time_s"))
    if rep.get("validation"):
        console.print("validation loss (held out, --eval-data) after step: " + ", ".join(
            f"{v['step']} {v['val_loss']:.4f} (perplexity {v['val_perplexity']:.2f})"
            for v in rep["validation"]), soft_wrap=True, highlight=False)
    if rep.get("stragglers"):
        print_stragglers(console, rep["stragglers"])
    if rep.get("plan"):
        from plait.observe.plan_check import print_plan_check

        print_plan_check(console, rep["plan"])
    for n in rep["notes"]:
        console.print(f"note: {n}")


def _refuse(msg: str) -> int:
    print(f"plait: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from plait.observe.visuals import visual_problems, write_visuals
    from plait.train.flags import config_from_args

    problems = visual_problems(args)  # outputs and matplotlib, before reading anything
    if problems:
        return _refuse("cannot write the report:\n" + "\n".join(f"  - {p}" for p in problems))
    try:
        rows, summary = read_metrics(args.metrics)
    except (OSError, ValueError) as e:
        return _refuse(f"--metrics {args.metrics}: {getattr(e, 'strerror', None) or e}")
    if not rows:
        return _refuse(f"--metrics {args.metrics} holds no step rows; give the file plait "
                       "train --metrics-out wrote")
    recorded, given = "config" in summary, _flags_given(args)
    if recorded and given and not args.override_config:
        return _refuse(f"{args.metrics} records the run's configuration "
                       f"({summary.get('layout')}); the configuration flags given beside it "
                       "would replace it: drop them, or add --override-config to report "
                       "against theirs")
    visual = bool(args.html or args.png_dir)
    if not recorded and not given and not visual:
        return _refuse(f"{args.metrics} has no config in its summary line; pass "
                       "--config run.toml or the run's train flags")
    plan = None
    if getattr(args, "plan", None):
        from plait.observe.plan_check import read_plan

        try:
            plan = read_plan(args.plan)
        except (OSError, ValueError) as e:
            return _refuse(f"--plan {args.plan}: {getattr(e, 'strerror', None) or e}")
    cfg, rep = None, None
    if recorded or given:
        try:
            cfg = config_from_args(args) if given else config_from_dict(summary["config"])
            cfg.check(cfg.parallel.world_size)
        except (ConfigError, TypeError, KeyError) as e:
            return _refuse(str(e))
        rep = compare(rows, summary, cfg)
        if plan is not None:
            from plait.observe.plan_check import compare_plan

            rep["plan"] = compare_plan(plan, cfg, rows, rep["communication"])
        if args.json:
            print(json.dumps(rep, indent=1, default=lambda o: dataclasses.asdict(o)))
        else:
            print_report(rep)
    if visual:
        write_visuals(args, rows, summary, cfg, rep)
    return 0
