"""`plait simulate`: build (or load) a schedule, check it, simulate it, show the result.

    plait simulate --schedule zb-v --pp 4 --microbatches 8 [--virtual-stages 2]
        [--forward 1 --backward-input 1 --backward-weight 1 --p2p 0]
        [--steps K --optimizer-sync barrier|post_validation [--check T]]
        [--png out.png] [--trace out.json] [--save sched.txt] [--load sched.txt]
        [--show] [--json]

--steps K lays out K consecutive steps: with the barrier (the default) every rank starts a
step when the last has finished the one before; with post_validation (Qi et al. 2023,
section 4) each rank starts as soon as its own previous step is done, and from the second step on
spends --check (default 0) at its cut, the end of its forward-only prefix, where the
previous step's update is checked. The steady state is steps 2..K.

Exit status: 0 ok, 2 when the request is impossible or the schedule fails a check.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from plait.files import artifact_problems, output_problems, write_text_atomic
from plait.schedule.check import check, deadlocks
from plait.schedule.ir import Schedule, without_gc
from plait.schedule.lower import lower
from plait.schedule.registry import (
    SCHEDULE_NAMES,
    SCHEDULES,
    build_schedule,
    closed_form_bubble,
    natural_virtual_stages,
    paper_bubble_time,
)
from plait.schedule.simulate import (
    OPTIMIZER_SYNCS,
    DeadlockError,
    Durations,
    events_of,
    result_of,
    simulate,
)


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
    sp.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b", help="default 1f1b")
    sp.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    sp.add_argument("--microbatches", "-m", type=int, default=8,
                    help="micro-batches per step (default 8)")
    sp.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help=f"stages per rank (default: {_default_v_help()})",
    )
    sp.add_argument("--forward", type=float, default=1.0,
                    help="T_F per stage per micro-batch (default 1)")
    sp.add_argument("--backward-input", type=float, default=1.0, help="T_I (B = I + W; default 1)")
    sp.add_argument("--backward-weight", type=float, default=1.0, help="T_W (default 1)")
    sp.add_argument("--p2p", type=float, default=0.0, help="one transfer between ranks (default 0)")
    sp.add_argument("--steps", type=int, default=1,
                    help="consecutive steps to lay out (default 1); the steady state is "
                    "steps 2..K")
    sp.add_argument("--optimizer-sync", choices=OPTIMIZER_SYNCS, default="barrier",
                    help="between steps: barrier (every rank waits for the last; default) "
                    "or post_validation (a rank goes on when its own step is done)")
    sp.add_argument("--check", type=float, default=0.0,
                    help="post_validation: a rank's time checking the previous step's "
                    "update at its cut, from the second step on (default 0)")
    sp.add_argument("--png", help="draw the timeline to this PNG (needs matplotlib)")
    sp.add_argument("--trace", help="write a Chrome trace (open in Perfetto)")
    sp.add_argument("--save", help="write the lowered schedule as text")
    sp.add_argument("--load", help="read a schedule from text instead of building one")
    sp.add_argument("--force", action="store_true", help="replace an existing --png or "
                    "--save file (by default plait refuses to; --trace is always rewritten)")
    sp.add_argument("--show", action="store_true", help="print the schedule as a time grid")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")


def _default_v_help() -> str:
    """E.g. '2 for interleaved, zb-v, dualpipev; else 1', from the registry."""
    by_v: dict[int, list[str]] = {}
    for name, spec in SCHEDULES.items():
        if spec.virtual_stages != 1:
            by_v.setdefault(spec.virtual_stages, []).append(name)
    return "; ".join([f"{v} for {', '.join(names)}" for v, names in by_v.items()] + ["else 1"])


# what the simulator lays out in seconds; past these a request is refused at once
MAX_PP, MAX_MICROBATCHES, MAX_VIRTUAL_STAGES, MAX_STEPS = 512, 20_000, 32, 1_000
MAX_ACTIONS = 2_000_000


def input_problems(args: argparse.Namespace) -> list[str]:
    """Every bad flag value, each with its fix, before anything is built or written."""
    problems = []
    for flag, value, hi in (("--pp", args.pp, MAX_PP),
                            ("--microbatches", args.microbatches, MAX_MICROBATCHES),
                            ("--virtual-stages", args.virtual_stages, MAX_VIRTUAL_STAGES),
                            ("--steps", args.steps, MAX_STEPS)):
        if value is not None and not 1 <= value <= hi:
            problems.append(f"{flag} {value} must be between 1 and {hi:,}"
                            + (" (leave it out for the schedule's own)"
                               if flag == "--virtual-stages" else ""))
    if not problems and args.load is None:
        v = args.virtual_stages or 1
        k = args.steps
        if args.pp * args.microbatches * v * 3 * k > MAX_ACTIONS:
            steps = f" x --steps {k}" if k > 1 else ""
            problems.append(f"--pp {args.pp} x --microbatches {args.microbatches} x "
                            f"--virtual-stages {v}{steps} is past what the simulator lays "
                            f"out (at most {MAX_ACTIONS:,} actions); use fewer micro-batches"
                            + (" or steps" if k > 1 else ""))
    for flag, value in (("--forward", args.forward), ("--backward-input", args.backward_input),
                        ("--backward-weight", args.backward_weight), ("--p2p", args.p2p),
                        ("--check", args.check)):
        if not math.isfinite(value) or value < 0:
            problems.append(f"{flag} {value} is a duration: use a finite number >= 0")
    if args.forward == 0 and args.backward_input == 0 and args.backward_weight == 0:
        problems.append("--forward, --backward-input and --backward-weight are all 0: "
                        "nothing to simulate; give at least one a positive duration")
    if args.load is not None and not Path(args.load).is_file():
        problems.append(f"--load {args.load}: no such file; give a schedule saved by --save")
    inputs = [args.load] if args.load else []
    for flag in ("png", "trace", "save"):
        out = getattr(args, flag)
        if out is None:
            continue
        if flag == "trace":  # a trace, like metrics, is rewritten by a rerun
            problems += output_problems(f"--{flag}", out, inputs)
        else:  # the picture and the schedule are artifacts
            problems += artifact_problems(f"--{flag}", out, inputs,
                                          getattr(args, "force", False))
    return problems


def _load(path: Path) -> Schedule:
    """A schedule saved by --save; anything else is a ValueError saying so."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--load {path} is binary, not a schedule saved by --save") from None
    head = text.lstrip().split("\n", 1)[0].split(",")
    sizes = dict(kv.split("=", 1) for kv in head[2:] if "=" in kv)
    for key, hi in (("pp", MAX_PP), ("microbatches", MAX_MICROBATCHES)):
        value = sizes.get(key, "")
        if value.strip().isdigit() and not 1 <= int(value) <= hi:
            raise ValueError(f"--load {path}: {key}={value} must be between 1 and {hi:,}")
    try:
        return Schedule.from_text(text)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"--load {path} is not a schedule saved by --save ({e!s})") from None


def _write_outputs(args: argparse.Namespace, res, compute_only: Schedule,
                   lowered: Schedule) -> None:
    """--save, --trace, --png, each written whole (plait/files.py) and announced."""
    written = []
    if args.save:
        written.append(("schedule", write_text_atomic(args.save, lowered.to_text())))
    if args.trace:
        from plait.schedule.draw import to_chrome_trace  # only when asked

        written.append(("Chrome trace", to_chrome_trace(res.events, args.trace)))
    if args.png:
        from plait.schedule.draw import draw_timeline

        written.append(("timeline PNG", draw_timeline(res, compute_only, args.png)))
    for what, path in written:  # stderr: --json's stdout stays one document
        print(f"{what} written to {path}", file=sys.stderr)


@without_gc  # one pause for build, check and simulate (ir.without_gc says why)
def run(args: argparse.Namespace) -> int:
    problems = input_problems(args)
    layout: list = []  # a list-scheduled order's own lay-out, for the durations built for
    if problems:
        print("error: invalid input:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    try:
        if args.load:
            schedule = _load(Path(args.load))
        else:
            v = natural_virtual_stages(args.schedule, args.virtual_stages)
            schedule = build_schedule(args.schedule, args.pp, args.microbatches, v,
                                      layout=layout)
    except (ValueError, OSError) as e:  # a text that is not a schedule, too
        print(f"error: {e}", file=sys.stderr)
        return 2
    compute_only = schedule
    # a builder's schedule is compute only; a loaded one may hold transfers
    has_transfers = bool(args.load) and any(len(a[0]) > 1 for acts in schedule.actions
                                            for a in acts)
    if has_transfers:
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
    # a schedule without transfers is executed by the simulation itself (the same
    # dependencies as check's execution); the deadlock report is asked for only if it
    # cannot finish. One with transfers is executed under the runtime contract (check.py).
    problems = check(schedule, execute=has_transfers)
    lowered = schedule if schedule.lowered else None
    if not problems and lowered is None and args.save:  # the lowering written is checked
        lowered = lower(compute_only)
        problems = check(lowered)
    d = Durations(args.forward, args.backward_input, args.backward_weight, args.p2p,
                  check=args.check)
    res = None
    draw = bool(args.trace or args.png)  # only drawings read the events
    if not problems and layout and layout[0] == d and args.steps == 1:
        res = result_of(schedule, *layout[1:], [len(a) for a in schedule.actions],
                        events=events_of(schedule.actions, *layout[1:]) if draw else None)
    elif not problems:
        try:
            res = simulate(compute_only, d, args.steps, args.optimizer_sync, events=draw)
        except DeadlockError:
            problems = deadlocks(schedule)
    if problems:
        print(f"error: schedule {schedule.name!r} fails its checks:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2

    _write_outputs(args, res, compute_only, lowered)
    summary = _summary(schedule, res, d)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_table(summary)
    if args.show:
        from plait.schedule.draw import format_table

        print(format_table(compute_only))
    return 0


def _summary(schedule: Schedule, res, d: Durations) -> dict:
    """What --json prints (and the table shows)."""
    name, p, m, v = (schedule.name, schedule.pp, schedule.microbatches,
                     schedule.virtual_stages)
    summary = {
        "schedule": name, "pp": p, "microbatches": m, "virtual_stages": v,
        "durations": {"forward": d.forward, "backward_input": d.backward_input,
                      "backward_weight": d.backward_weight, "p2p": d.p2p,
                      "check": d.check},
        "step_time": res.step_time,
        "bubble_fraction": res.bubble_fraction,
        "closed_form_bubble": closed_form_bubble(name, p, m, v, d),
        "paper_bubble_time": paper_bubble_time(name, p, m, v, d),
        "bubble_per_rank": res.bubble_per_rank,
        "span_idle_per_rank": res.span_idle_per_rank,
        "busy_per_rank": res.busy_per_rank,
        "peak_activations": res.peak_activations,
    }
    if res.steps > 1 or res.optimizer_sync != "barrier":  # (one step: as before)
        summary["steps"] = {
            "steps": res.steps, "optimizer_sync": res.optimizer_sync,
            "step_ends": res.step_ends, "steady_step_time": res.steady_step_time,
            "steady_bubble_fraction": res.steady_bubble_fraction,
        }
    return summary


def _print_table(s: dict) -> None:
    rows = [("schedule", s["schedule"]),
            ("pp / microbatches / virtual stages",
             f"{s['pp']} / {s['microbatches']} / {s['virtual_stages']}")]
    dd = s["durations"]
    rows.append(("T_F / T_I / T_W / p2p", f"{dd['forward']:g} / {dd['backward_input']:g} / "
                 f"{dd['backward_weight']:g} / {dd['p2p']:g}"))
    rows.append(("step time", f"{s['step_time']:.6g}"))
    rows.append(("bubble fraction", f"{s['bubble_fraction']:.4f}"))
    cf = s["closed_form_bubble"]
    rows.append(("closed form", "n/a (see docs/pipeline.md)" if cf is None else f"{cf:.4f}"))
    pb = s["paper_bubble_time"]
    rows.append(("paper's bubble time per rank", "n/a" if pb is None else f"{pb:.4g}"))
    rows.append(("idle inside each rank's span",
                 " ".join(f"{x:.3g}" for x in s["span_idle_per_rank"])))
    rows.append(("peak activations per rank", " ".join(map(str, s["peak_activations"]))))
    if "steps" in s:
        k = s["steps"]
        rows.append(("steps / between them", f"{k['steps']} / {k['optimizer_sync']}"))
        if dd["check"] and k["optimizer_sync"] == "post_validation":
            rows.append(("check at each rank's cut (steps 2..K)", f"{dd['check']:g}"))
        if k["steady_step_time"] is None:
            rows.append(("steady state", "needs --steps 2 or more (it is steps 2..K)"))
        else:
            rows.append(("steady-state step time (steps 2..K)", f"{k['steady_step_time']:.6g}"))
            rows.append(("steady-state bubble fraction",
                         f"{k['steady_bubble_fraction']:.4f}"))
    print(box_table("plait simulate", ("quantity", "value"), rows))


def box_table(title: str, header: tuple[str, str], rows: list[tuple[str, str]],
              width: int | None = None) -> str:
    """A two-column table in box characters, the value column wrapped at word breaks to
    fit the terminal (80 columns when it is not one). Plain string formatting: `rich`
    costs `plait simulate` a tenth of a second to import."""
    import shutil
    import textwrap

    width = width or shutil.get_terminal_size((80, 24)).columns
    left = max(len(header[0]), *(len(k) for k, _ in rows))
    room = max(width - left - 7, 10)  # borders and padding: "│ k │ v │"
    cells = [(k, textwrap.wrap(v, room) or [""]) for k, v in rows]
    right = max(len(header[1]), *(len(x) for _, lines in cells for x in lines))
    out = [title.center(left + right + 7).rstrip(),
           f"┏{'━' * (left + 2)}┳{'━' * (right + 2)}┓",
           f"┃ {header[0]:<{left}} ┃ {header[1]:<{right}} ┃",
           f"┡{'━' * (left + 2)}╇{'━' * (right + 2)}┩"]
    for k, lines in cells:
        for n, line in enumerate(lines):
            out.append(f"│ {k if n == 0 else '':<{left}} │ {line:<{right}} │")
    out.append(f"└{'─' * (left + 2)}┴{'─' * (right + 2)}┘")
    return "\n".join(out)
