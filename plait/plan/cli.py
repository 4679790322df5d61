"""`plait plan`: search every layout, or evaluate one (`--layout`).

Wired into plait/cli/main.py by `add_parser(subparsers)`; `run(args)` returns the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from plait.dims import DEFAULT_ORDER
from plait.plan import fp8, host_share, trust
from plait.plan import stack as stack_args
from plait.plan.basis import WRITTEN
from plait.plan.bubble import chunks_per_rank
from plait.plan.compute import FLOP_DEFINITIONS, Efficiency
from plait.plan.emit import emit_plan
from plait.plan.estimate import Estimate, Training, evaluate
from plait.plan.explain import explain, why_no_fit
from plait.plan.explain_terms import explain_terms
from plait.plan.goodput import (
    Failures,
    add_goodput_arguments,
    failures_from_args,
    goodput_flag_problems,
    goodput_lines,
    layout_goodput,
    layouts_goodput,
)
from plait.plan.gpu_data import EFFICIENCY_MODES
from plait.plan.hardware import GB, GPUS, Cluster
from plait.plan.inputs import (
    DEFAULT_ORDER_TEXT,
    OPTIONAL_SIZES,
    apply_defaults,
    parse_layout,
    plan_flag_problems,
)
from plait.plan.memory import OPTIMIZERS, PRECISIONS, RECOMPUTE
from plait.plan.model_flags import (
    RUNTIME_NOTE,
    ShapeError,
    add_model_arguments,
    describe,
    shape_from_args,
)
from plait.plan.plot import plot_memory
from plait.plan.profile import base_gpu, hardware_of
from plait.plan.published import published_batch, throughput_note
from plait.plan.search import PlanError, layout_problems, order_notes, search
from plait.plan.sequence_modes import mode_notes
from plait.plan.shape import ATTENTION, ATTENTION_HELP, Shape
from plait.plan.stack_note import stack_lines
from plait.plan.units import flops_rate, nbytes, params
from plait.schedule.registry import SCHEDULE_NAMES, schedule_spec
from plait.schedule.simulate import OPTIMIZER_SYNCS

_USAGE = __doc__.split("\n\n")[0]  # the first paragraph; the rest is for readers of the code

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="search or evaluate parallel layouts",
                              description=_USAGE)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_layout_arguments(lay: Any) -> None:
    """The flags of one layout (`--layout` and what it is run with)."""
    lay.add_argument("--layout", help=f"e.g. tp=8,pp=8,dp=16[{OPTIONAL_SIZES}]")
    lay.add_argument("--micro-batch-size", "--microbatch", dest="microbatch", type=int,
                     default=None, metavar="N",
                     help="sequences per micro-batch, as plait train's (default 1)")
    lay.add_argument("--microbatches", type=int, metavar="N",
                     help="micro-batches per data-parallel replica, as plait train's: "
                     "instead of --micro-batch-size (global batch / dp / N sequences each)")
    lay.add_argument("--schedule", default="1f1b", choices=list(SCHEDULE_NAMES),
                     help="default 1f1b")
    lay.add_argument("--virtual-stages", type=int, default=1, metavar="N",
                     help="stages per rank for interleaved (default 1; the V schedules fix 2)")
    lay.add_argument("--recompute", default="none", choices=list(RECOMPUTE),
                     help="what backward computes again: none (nothing; default, as plait "
                     "train), selective (math: the probabilities; flash: plait train's "
                     "list, the attention core and element-wise ops, keeping the matmul "
                     "outputs), full (all but each layer's input)")
    lay.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3),
                     help="default 1 (plait train's default: 0)")
    lay.add_argument("--no-sp", action="store_true", help="TP without sequence parallelism")
    lay.add_argument("--async-tp", action="store_true",
                     help="sequence parallel's all-gathers and reduce-scatters as ring hops "
                     "beside their matmuls' chunks (plait train's parallel.async_tp; "
                     "Megatron-LM's --tp-comm-overlap); the search uses it too")
    lay.add_argument("--overlap-fb", action="store_true",
                     help="dualpipe/dualpipev's F&B pairs run overlapped (plait train's "
                     "--overlap-fb): only then are a pair's expert all-to-alls priced as "
                     "hidden behind the other micro-batch; the search uses it too")
    lay.add_argument("--order", default=",".join(DEFAULT_ORDER), metavar="DIMS",
                     help="the mesh order, innermost first, as parallel.order (default "
                     f"{','.join(DEFAULT_ORDER)}: tp inside a node); decides which groups "
                     "cross nodes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    h = p.add_argument_group("hardware")
    h.add_argument("--gpu", default=None,
                   help=f"preset: {', '.join(GPUS)} (default h100-sxm)")
    h.add_argument("--hardware", metavar="PROFILE.json",
                   help="plan with a profile plait calibrate measured (its GEMM curve, "
                   "attention, memory and collective speeds) instead of a --gpu preset")
    h.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs")
    h.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU (default: "
                   "the preset's)")
    h.add_argument("--hbm-gb", type=float, help="HBM per GPU, GB (default: the preset's)")
    h.add_argument("--hbm-bw-gbs", type=float, help="HBM GB/s (default: the preset's)")
    h.add_argument("--nvlink-gbs", type=float, help="per GPU per direction (default: the "
                   "preset's)")
    h.add_argument("--internode-gbs", type=float, help="per GPU per direction (default: the "
                   "preset's)")
    h.add_argument("--gpus-per-node", type=int, metavar="N", help="default: the preset's")
    h.add_argument("--nics-per-node", type=int, metavar="N", help="NICs of --internode-gbs "
                   "a node's GPUs share (default: one a GPU, as the DGX presets)")
    h.add_argument("--efficiency", default="published", choices=EFFICIENCY_MODES,
                   help="GEMM, attention and link efficiency: published (default: per-GPU "
                   "public measurements, plait/plan/data/gpu_efficiency.json; links are "
                   "then NCCL bus bandwidths) or fitted (the constants fitted on one A100 "
                   "paper, links = datasheet x a fitted efficiency)")
    host_share.add_arguments(h)
    t = p.add_argument_group("training")
    t.add_argument("--global-batch", type=int, metavar="N", help="sequences per step")
    t.add_argument("--global-batch-tokens", type=int, metavar="N",
                   help="tokens per step (/ seq), instead of --global-batch")
    # fp64 is the parity oracle's precision on CPU, not a GPU run the planner prices
    t.add_argument("--precision", default=None, choices=[p for p in PRECISIONS if p != "fp64"],
                   help="default bf16, what GPU runs use (plait train's default: fp32); "
                   "fp8: the blocks' linears in float8 at the GPU's float8 peak "
                   "(docs/float8.md)")
    t.add_argument("--optimizer", default="adam", choices=list(OPTIMIZERS), help="default adam")
    t.add_argument("--mem-limit", type=float, default=0.9,
                   help="usable fraction of HBM (default 0.9)")
    t.add_argument("--attention", default="flash", choices=list(ATTENTION),
                   help="attention kernel: flash (default: SDPA on GPUs and plait's CPU "
                   f"runtime) {ATTENTION_HELP['flash']}; math {ATTENTION_HELP['math']} "
                   "(Korthikanti et al.'s GPT runs: --arch gpt --attention math)")
    t.add_argument("--optimizer-sync", default="barrier", choices=OPTIMIZER_SYNCS,
                   help="between steps (parallel.optimizer_sync): barrier (every pipeline "
                   "rank waits for the last; default) or post_validation (the simulated "
                   "pipeline time is the steady state of consecutive steps)")
    _add_layout_arguments(p.add_argument_group("one layout (instead of searching)"))
    stack_args.add_arguments(p.add_argument_group("how the stack runs it"))
    add_goodput_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, metavar="N", help="layouts shown (default 5)")
    o.add_argument("--json", action="store_true", help="print the result as JSON")
    trust.add_arguments(o)
    o.add_argument("--plot", help="draw the memory breakdown of the shown layouts to this PNG")
    o.add_argument("--emit-config", metavar="RUN.toml",
                   help="write the best layout plait train can run as a config for "
                   "`plait train --config RUN.toml`, and its plan beside it (RUN.plan.json, "
                   "for `plait report --plan`)")
    o.add_argument("--force", action="store_true", help="replace an existing --plot or "
                   "--emit-config file (by default plait refuses to)")


def build_inputs(args: argparse.Namespace) -> tuple[Shape, Cluster, Training]:
    try:
        shape = shape_from_args(args)
    except ShapeError as exc:
        raise PlanError(str(exc)) from None
    scale = {"peak_flops": (args.peak_tflops, 1e12), "hbm_bytes": (args.hbm_gb, GB),
             "hbm_bw": (args.hbm_bw_gbs, GB), "nvlink_bw": (args.nvlink_gbs, GB),
             "internode_bw": (args.internode_gbs, GB)}
    over: dict[str, Any] = {k: v * f for k, (v, f) in scale.items() if v is not None}
    if args.gpus_per_node:
        over["gpus_per_node"] = args.gpus_per_node
    if args.nics_per_node:
        over["nics_per_node"] = args.nics_per_node
    if getattr(args, "host_cores", None) is not None:
        over["host_cores"] = args.host_cores
    gpu = base_gpu(args, over)
    if args.gpus is None or args.gpus < 1:
        raise PlanError("--gpus must be >= 1")
    if args.global_batch is None and args.global_batch_tokens is None:
        if published_batch(args.model) is None:
            raise PlanError("give --global-batch (sequences) or --global-batch-tokens")
        args.global_batch = published_batch(args.model)  # the paper's (plan/published.py)
    batch = args.global_batch
    if batch is None:
        if args.global_batch_tokens % shape.seq:
            raise PlanError(f"--global-batch-tokens {args.global_batch_tokens} is not a "
                            f"multiple of the sequence length {shape.seq}")
        batch = args.global_batch_tokens // shape.seq
    cluster = Cluster(gpu, args.gpus, getattr(args, "ranks_per_host", None),
                      getattr(args, "host_load", 0.0))
    if args.precision == fp8.FP8:
        problems = fp8.plan_problems(shape, gpu, args.efficiency, bool(args.hardware))
        if problems:
            raise PlanError("; ".join(problems))
    return shape, cluster, Training(batch, args.precision, args.optimizer, args.mem_limit,
                                    args.optimizer_sync, stack_args.stack_from_args(args))


def _num(x: Any) -> Any:
    if isinstance(x, np.ndarray | np.generic):
        return x.item()
    return x


def to_dict(e: Estimate) -> dict[str, Any]:
    lay = e.layout
    return {
        "layout": {k: _num(lay.sizes[k]) for k in WRITTEN},
        "microbatch": _num(lay.mbs), "microbatches": _num(e.microbatches),
        "schedule": lay.schedule, "virtual_stages": _num(lay.v), "zero": lay.zero,
        "recompute": lay.recompute, "attention": lay.attention, "sequence_parallel": lay.sp,
        "async_tp": bool(lay.async_tp),
        **({} if tuple(lay.order) == DEFAULT_ORDER else {"order": ",".join(lay.order)}),
        "step_time_s": _num(e.step_time), "tokens_per_s": _num(e.tokens_per_s),
        "model_tflops_per_gpu": _num(e.model_tflops),
        "hardware_tflops_per_gpu": _num(e.hardware_tflops), "mfu": _num(e.mfu),
        "bubble_fraction": _num(e.bubble_fraction),
        "flops_per_step": {"model": _num(e.extra["model_flops"]),
                           "hardware": _num(e.extra["hardware_flops"])},
        "time_breakdown_s": {k: _num(v) for k, v in e.time.items()},
        "memory_bytes": {k: _num(v) for k, v in e.memory.items()},
        "memory_total_bytes": _num(e.memory_total), "memory_peak_rank": _num(e.peak_rank),
        "fits": bool(e.fits),
        "pipeline_source": e.extra.get("pipeline", {}).get("source"),
        # what the pipeline time assumes between steps (parallel.optimizer_sync)
        "pipeline_optimizer_sync": e.extra.get("pipeline", {}).get("optimizer_sync"),
        "collectives": [
            {"dim": c.dim, "op": c.op, "bytes": _num(c.size), "count": _num(c.count),
             "group": _num(c.group), "link": "nvlink" if bool(c.intra) else "inter-node",
             "time_each_s": _num(c.time_each), "total_s": _num(c.total),
             "exposed_s": _num(c.exposed), "overlaps_with": c.overlap}
            for c in e.collectives],
    }


def _source(e: Estimate) -> str:
    src = e.extra.get("pipeline", {}).get("source") or "-"
    return "simulated" if src.startswith("simulator") else src.split(" (")[0]


def _print(console: Any, shape: Shape, cluster: Cluster, ests: list[Estimate],
           notes: list[str], header: str) -> None:
    from rich.table import Table

    # prose lines unwrapped (the terminal wraps them): each stays one line to grep
    console.print(header, soft_wrap=True)
    t = Table(title="layouts (best first)", padding=(0, 0))
    for col in ("#", "layout", "mb x n", "schedule", "ZeRO", "recompute", "step s",
                "tokens/s", "model FLOP/s/GPU", "hw FLOP/s/GPU", "MFU", "bubble",
                "mem/GPU", "fits", "pipeline"):
        t.add_column(col, no_wrap=col == "layout")
    for k, e in enumerate(ests, 1):
        lay = e.layout
        free_v = schedule_spec(lay.schedule).free_virtual_stages
        sched = lay.schedule + (f" v={lay.v}" if free_v else "")
        t.add_row(str(k), lay.label(), f"{lay.mbs}x{int(e.microbatches)}",
                  sched if lay.pp > 1 else "-", str(lay.zero), lay.recompute,
                  f"{float(e.step_time):.3f}", f"{float(e.tokens_per_s):,.0f}",
                  flops_rate(1e12 * float(e.model_tflops)),
                  flops_rate(1e12 * float(e.hardware_tflops)),
                  f"{float(e.mfu):.1%}", f"{float(e.bubble_fraction):.1%}",
                  nbytes(e.memory_total), "yes" if bool(e.fits) else "NO",
                  _source(e))
    console.print(t)
    best = ests[0]
    tt = Table(title=f"step time, {best.layout.label()}")
    tt.add_column("term")
    tt.add_column("seconds", justify="right")
    for k, v in best.time.items():
        tt.add_row(k, f"{float(v):.4f}")
    tt.add_row("step", f"{float(best.step_time):.4f}")
    mt = Table(title=f"memory per rank ({best.peak_rank} pipeline rank)")
    mt.add_column("category")
    mt.add_column("bytes", justify="right")
    for k, v in best.memory.items():
        mt.add_row(k, nbytes(v))
    mt.add_row("total", nbytes(best.memory_total))
    console.print(tt)
    console.print(mt)
    ct = Table(title="collectives per step (most loaded rank)")
    for col in ("dim", "op", "each", "count", "group", "link", "ms each", "total s",
                "exposed s", "overlaps with"):
        ct.add_column(col)
    for c in best.collectives:
        ct.add_row(c.dim, c.op, nbytes(c.size), f"{float(c.count):,.0f}",
                   str(int(c.group)), "NVLink" if bool(c.intra) else "inter-node",
                   f"{1e3 * float(c.time_each):.3f}", f"{float(c.total):.4f}",
                   f"{float(c.exposed):.4f}", c.overlap)
    console.print(ct)
    console.print(flops_line(best), soft_wrap=True)
    src = best.extra.get("pipeline", {}).get("source")
    if src:
        sync = best.extra["pipeline"].get("optimizer_sync")
        between = {"barrier": "one step, every pipeline rank waiting for the last before "
                   "the next (optimizer barrier)",
                   "post_validation": "the steady state of consecutive steps, each rank "
                   "starting its next as soon as its own is done (post-validation; its "
                   "optimizer states include the copy held until the check, 12 bytes a "
                   "parameter of the optimizer's shard)"}
        console.print(f"pipeline time from: {src}"
                      + (f"; assumes {between[sync]}" if sync in between else ""),
                      soft_wrap=True)
    for line in notes:
        console.print(line, soft_wrap=True)


def flops_line(e: Estimate) -> str:
    """The step's FLOPs, both counts, saying what each counts (FLOP_DEFINITIONS in full)."""
    return (f"FLOPs per step: model {float(e.extra['model_flops']):.4g} (6N + attention, "
            "PaLM appendix B; causal kernels count half the scores), hardware "
            f"{float(e.extra['hardware_flops']):.4g} (what the {e.layout.attention} "
            f"attention kernel executes + what recompute {e.layout.recompute} runs again).")


def _choose(args: argparse.Namespace, shape: Shape, cluster: Cluster, train: Training,
            fail: Failures | None, eff: Efficiency
            ) -> tuple[list[Estimate], list[str], dict[str, Any]]:
    """The layouts to show (best first), the notes on them, the search's counts."""
    if args.layout:
        lay = parse_layout(args.layout, args, train.global_batch)
        problems = layout_problems(shape, cluster, train, lay) + stack_args.stage_problems(
            shape.layers, int(lay.pp), int(chunks_per_rank(lay.schedule, lay.v)), train.stack)
        if problems:
            raise PlanError("invalid layout:\n" + "\n".join(f"  - {p}" for p in problems))
        est = evaluate(shape, cluster, train, lay, eff, simulate=True)
        why = "" if bool(est.fits) else why_no_fit(est, cluster, train, searched=False)
        notes = [f"does NOT fit: {why}"] if why else []
        return [est], notes, {}
    if getattr(args, "order", DEFAULT_ORDER_TEXT) != DEFAULT_ORDER_TEXT:
        raise PlanError(f"--order {args.order}: the search tries every mesh order itself "
                        "and says which it recommends; give --layout too to evaluate one "
                        "layout under --order")
    if train.stack.uneven():
        raise PlanError("--first-stage-layers/--last-stage-layers describe one layout's "
                        "stages: give --layout too")
    cost = None
    if args.rank_by == "goodput" and fail is not None:
        def cost(e: Estimate) -> Any:  # seconds per useful step under failures
            return layout_goodput(e, shape, train, cluster.n_gpus, fail)[
                "seconds_per_useful_step"]
    res = search(shape, cluster, train, eff, top=args.top, cost=cost, attention=args.attention,
                 async_tp=args.async_tp, overlap_fb=args.overlap_fb)
    doc: dict[str, Any] = {"layouts_considered": res.considered,
                           "layouts_fitting": res.feasible}
    if cost:
        doc["ranked_by"] = "goodput"
    if not res.top:
        raise PlanError(why_no_fit(res.closest, cluster, train))
    notes = [f"{res.considered:,} layouts considered, {res.feasible:,} fit"
             + (", ranked by goodput (useful tokens/s under failures)." if cost else ".")]
    notes += explain(res.top[0], shape, cluster, train, res.extra.get("best_by"),
                     res.top[1] if len(res.top) > 1 else None) + order_notes(res.top[0])
    notes += mode_notes(shape, cluster, train, res.top[0].layout, eff)
    return res.top, notes, doc


def run(args: argparse.Namespace, out: Any = None) -> int:
    from rich.console import Console

    console = Console(file=out or sys.stdout, width=160)
    err = Console(file=out or sys.stderr, width=160)
    unlike_train = apply_defaults(args)
    try:
        problems = plan_flag_problems(args) + goodput_flag_problems(args) \
            + host_share.problems(args)
        if problems:
            raise PlanError("invalid input:\n" + "\n".join(f"  - {p}" for p in problems))
        shape, cluster, train = build_inputs(args)
        header = (f"{shape.name}: {params(shape.num_params())} params, seq {shape.seq}; "
                  f"{cluster.n_gpus} x {cluster.gpu.name}; global batch "
                  f"{train.global_batch} sequences ({train.global_batch * shape.seq:,} tokens)"
                  f"; attention {args.attention} ({ATTENTION_HELP[args.attention]})"
                  + ("\ndefaults unlike plait train's: " + ", ".join(unlike_train)
                     if unlike_train else ""))
        fail = failures_from_args(args)
        ests, notes, doc = _choose(args, shape, cluster, train, fail, hardware_of(args)[1])
        header = "\n".join([header, *stack_lines(args, shape, cluster, train, ests[0])])
        gps = layouts_goodput(ests, shape, train, cluster.n_gpus, fail) if fail else None
        if args.emit_config:
            notes += emit_plan(args, ests, gps, shape, cluster, train, to_dict)
    except (PlanError, ValueError) as exc:
        if getattr(args, "json", False):
            console.print_json(json.dumps({"error": str(exc)}))
        else:
            err.print(f"plait plan: error: {exc}", markup=False, highlight=False)
        return 2
    if args.plot:
        plot_memory(args.plot, ests)
        print(f"memory plot written to {args.plot}", file=sys.stderr)
    if shape.arch != "llama":
        notes.append(RUNTIME_NOTE)
    paper = throughput_note(args.model, shape.name, cluster.gpu.name, cluster.n_gpus,
                            float(ests[0].tokens_per_s), train.precision)
    notes += [paper] if paper else []
    notes += [line for line in [host_share.note(cluster)] if line]  # shared CPU cores
    eff = hardware_of(args)[1]
    pub = trust.plan_published(cluster, args.efficiency, bool(args.hardware),
                               args.attention_kernel)
    if train.precision != fp8.FP8:  # the published runs and the ceiling are bf16's
        notes += trust.mfu_flags(ests, cluster, pub, eff)
    notes += trust.step_range(ests[0], cluster, pub, train.stack, bool(shape.moe))
    notes += trust.provenance(cluster, pub, args.efficiency)
    if train.precision == fp8.FP8:
        notes += fp8.hardware_lines(cluster.gpu, eff, pub.entry if pub else None)
    if args.explain:
        notes += explain_terms(shape, cluster, train, ests[0], eff)
    if gps:
        notes += goodput_lines(gps[0])
        if len(gps) > 1:
            notes.append("Goodput of the layouts shown: " + ", ".join(
                f"#{k} {g['goodput']:.1%}" for k, g in enumerate(gps, 1)) + ".")
    if args.json:
        layouts = [to_dict(e) for e in ests]
        for d, g in zip(layouts, gps or []):
            d["goodput"] = g
        doc.update({"model": shape.name, "params": shape.num_params(), "gpus": cluster.n_gpus,
                    "gpu": cluster.gpu.name, "global_batch": train.global_batch,
                    "layouts": layouts, "explanation": notes,
                    "shape": describe(shape), "flop_definitions": FLOP_DEFINITIONS,
                    "attention": {"kernel": args.attention,
                                  "assumes": ATTENTION_HELP[args.attention]}})
        (out or sys.stdout).write(json.dumps(doc, indent=1) + "\n")
    else:
        _print(console, shape, cluster, ests, notes, header)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="plait plan", description=_USAGE)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
