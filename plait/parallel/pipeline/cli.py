"""`plait simulate`: build (or load) a schedule, check it, simulate it, show the result.

    plait simulate --schedule zb-v --pp 4 --microbatches 8 [--virtual-stages 2]
        [--forward 1 --backward-input 1 --backward-weight 1 --p2p 0]
        [--png out.png] [--trace out.json] [--save sched.txt] [--load sched.txt]
        [--show] [--json]

Exit status: 0 ok, 2 when the request is impossible or the schedule fails a check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plait.parallel.pipeline.check import check
from plait.parallel.pipeline.draw import format_table
from plait.parallel.pipeline.ir import Schedule
from plait.parallel.pipeline.lower import lower
from plait.parallel.pipeline.registry import (
    SCHEDULE_NAMES,
    SCHEDULES,
    build_schedule,
    closed_form_bubble,
    natural_virtual_stages,
    paper_bubble_time,
)
from plait.parallel.pipeline.simulate import Durations, simulate


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `simulate` on an argparse subparsers object; returns its parser."""
    sp = subparsers.add_parser(
        "simulate",
        help="simulate a pipeline schedule: timeline, bubble, peak activations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(sp)
    sp.set_defaults(func=run)
    return sp


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b")
    sp.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    sp.add_argument("--microbatches", "-m", type=int, default=8)
    sp.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help=f"stages per rank (default: {_default_v_help()})",
    )
    sp.add_argument("--forward", type=float, default=1.0, help="T_F per stage per micro-batch")
    sp.add_argument("--backward-input", type=float, default=1.0, help="T_I (B = I + W)")
    sp.add_argument("--backward-weight", type=float, default=1.0, help="T_W")
    sp.add_argument("--p2p", type=float, default=0.0, help="one transfer between ranks")
    sp.add_argument("--png", help="draw the timeline to this PNG (needs matplotlib)")
    sp.add_argument("--trace", help="write a Chrome trace (open in Perfetto)")
    sp.add_argument("--save", help="write the lowered schedule as text")
    sp.add_argument("--load", help="read a schedule from text instead of building one")
    sp.add_argument("--show", action="store_true", help="print the schedule as a time grid")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")


def _default_v_help() -> str:
    """E.g. '2 for interleaved, zb-v, dualpipev; else 1', from the registry."""
    by_v: dict[int, list[str]] = {}
    for name, spec in SCHEDULES.items():
        if spec.virtual_stages != 1:
            by_v.setdefault(spec.virtual_stages, []).append(name)
    return "; ".join([f"{v} for {', '.join(names)}" for v, names in by_v.items()] + ["else 1"])


def run(args: argparse.Namespace) -> int:
    try:
        if args.load:
            schedule = Schedule.from_text(Path(args.load).read_text())
        else:
            # 0 like omitted: the schedule's own
            v = natural_virtual_stages(args.schedule, args.virtual_stages or None)
            schedule = build_schedule(args.schedule, args.pp, args.microbatches, v)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compute_only = Schedule(
        schedule.name,
        schedule.pp,
        schedule.microbatches,
        schedule.virtual_stages,
        schedule.num_stages,
        schedule.stage_to_rank,
        [[a for a in acts if not a.is_comm] for acts in schedule.actions],
        schedule.num_chains,
    )
    lowered = schedule if schedule.lowered else None
    problems = check(schedule)
    if not problems and lowered is None:
        lowered = lower(compute_only)
        problems = check(lowered)
    if problems:
        print(f"error: schedule {schedule.name!r} fails its checks:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2

    d = Durations(args.forward, args.backward_input, args.backward_weight, args.p2p)
    res = simulate(compute_only, d)
    closed = closed_form_bubble(
        schedule.name, schedule.pp, schedule.microbatches, schedule.virtual_stages, d
    )
    if args.save:
        Path(args.save).write_text(lowered.to_text())
    if args.trace:
        from plait.parallel.pipeline.draw import to_chrome_trace

        to_chrome_trace(res.events, args.trace)
    if args.png:
        from plait.parallel.pipeline.draw import draw_timeline

        draw_timeline(res, compute_only, args.png)

    summary = {
        "schedule": schedule.name,
        "pp": schedule.pp,
        "microbatches": schedule.microbatches,
        "virtual_stages": schedule.virtual_stages,
        "durations": {
            "forward": d.forward,
            "backward_input": d.backward_input,
            "backward_weight": d.backward_weight,
            "p2p": d.p2p,
        },
        "step_time": res.step_time,
        "bubble_fraction": res.bubble_fraction,
        "closed_form_bubble": closed,
        "paper_bubble_time": paper_bubble_time(
            schedule.name, schedule.pp, schedule.microbatches, schedule.virtual_stages, d
        ),
        "bubble_per_rank": res.bubble_per_rank,
        "span_idle_per_rank": res.span_idle_per_rank,
        "busy_per_rank": res.busy_per_rank,
        "peak_activations": res.peak_activations,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_table(summary)
    if args.show:
        print(format_table(compute_only))
    return 0


def _print_table(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="plait simulate", show_header=True)
    t.add_column("quantity")
    t.add_column("value")
    t.add_row("schedule", s["schedule"])
    t.add_row(
        "pp / microbatches / virtual stages",
        f"{s['pp']} / {s['microbatches']} / {s['virtual_stages']}",
    )
    dd = s["durations"]
    t.add_row(
        "T_F / T_I / T_W / p2p",
        f"{dd['forward']:g} / {dd['backward_input']:g} / {dd['backward_weight']:g} / {dd['p2p']:g}",
    )
    t.add_row("step time", f"{s['step_time']:.6g}")
    t.add_row("bubble fraction", f"{s['bubble_fraction']:.4f}")
    cf = s["closed_form_bubble"]
    t.add_row("closed form", "n/a (see docs/pipeline.md)" if cf is None else f"{cf:.4f}")
    pb = s["paper_bubble_time"]
    t.add_row("paper's bubble time per rank", "n/a" if pb is None else f"{pb:.4g}")
    t.add_row("idle inside each rank's span", " ".join(f"{x:.3g}" for x in s["span_idle_per_rank"]))
    t.add_row("peak activations per rank", " ".join(map(str, s["peak_activations"])))
    Console().print(t)
