"""Pictures of a timeline: a PNG (matplotlib, Agg) and a Chrome trace (Perfetto-openable).

Both take plain per-rank event lists `(kind, stage, microbatch, start, end)`, so the same
code draws a simulated timeline and, later, a measured one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from plait.files import write_png, write_text_atomic
from plait.schedule.ir import Schedule
from plait.schedule.simulate import Durations, Event, SimResult, simulate

COLORS = {"F": "#4c8bf5", "B": "#f5a623", "I": "#e8603c", "W": "#57b85a"}


def draw_timeline(result: SimResult, schedule: Schedule, path_png: str | Path,
                  unit: str = "the unit of --forward", what: str = "step") -> Path:
    """One row per rank, one box per compute, labelled with its micro-batch (and the
    rank's chunk letter when it holds several stages). `unit`: what the events' times
    are in (a simulation's are the durations given to it; a measured step's, ms);
    `what`: the span the title's bubble is of. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = schedule.pp
    chunk = {}
    for r in range(p):
        stages = schedule.stages_on(r)
        for i, s in enumerate(stages):
            chunk[s] = "abcdefgh"[i] if len(stages) > 1 else ""
    width = max(8.0, min(40.0, 0.35 * sum(len(ev) for ev in result.events) / max(p, 1)))
    fig, ax = plt.subplots(figsize=(width, 0.6 * p + 1.4))
    for r, events in enumerate(result.events):
        for kind, stage, mb, start, end in events:
            ax.broken_barh(
                [(start, end - start)],
                (r - 0.4, 0.8),
                facecolors=COLORS.get(kind, "#999999"),
                edgecolors="black",
                linewidth=0.4,
            )
            # lighter shade for a rank's second (third...) chunk
            if chunk.get(stage) not in ("", "a"):
                ax.broken_barh(
                    [(start, end - start)], (r - 0.4, 0.8), facecolors="white", alpha=0.35
                )
            ax.text(
                (start + end) / 2,
                r,
                f"{mb}{chunk.get(stage, '')}",
                ha="center",
                va="center",
                fontsize=7,
            )
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    end = max((ev[-1][4] for ev in result.events if ev), default=0.0)
    ax.set_xlim(0, end or result.step_time or 1.0)  # several steps: all of them
    short = unit.split()[0] if unit == "ms" else "units"
    steady = ""
    if result.steps > 1:
        steady = (f"  steady ({result.optimizer_sync}) {result.steady_step_time:.4g} {short}, "
                  f"bubble {result.steady_bubble_fraction:.1%}")
    ax.set_title(
        f"{schedule.name}  pp={p} m={schedule.microbatches} v={schedule.virtual_stages}  "
        f"{what} {result.step_time:.4g} {short}  bubble {result.bubble_fraction:.1%}{steady}"
    )
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        ncol=4,
        fontsize=7,
    )
    fig.tight_layout()
    path = write_png(fig, path_png, dpi=120)
    plt.close(fig)
    return path


def to_chrome_trace(
    events_per_rank: Sequence[Sequence[Event]], path_json: str | Path, time_unit: float = 1e-6,
    nested: Sequence[Sequence[Event]] | None = None,
) -> Path:
    """Write a Chrome trace: one process per rank, one complete ("X") event per compute.
    `time_unit` is how many seconds one unit of the events' times is (1e-6: microseconds,
    the trace format's own unit; pass 1.0 for times in seconds). `nested`: spans inside
    the computes (the recomputation inside an I), drawn on a second row of the rank."""
    scale = time_unit / 1e-6
    trace = []
    rows = [(r, 0, evs) for r, evs in enumerate(events_per_rank)]
    rows += [(r, 1, evs) for r, evs in enumerate(nested or [])]
    for r, tid, events in rows:
        if tid == 0:
            trace.append({"name": "process_name", "ph": "M", "pid": r,
                          "args": {"name": f"rank {r}"}})
        for kind, stage, mb, start, end in events:
            trace.append(
                {
                    "name": f"{kind}{stage}.{mb}",
                    "cat": kind,
                    "ph": "X",
                    "pid": r,
                    "tid": tid,
                    "ts": start * scale,
                    "dur": (end - start) * scale,
                    "args": {"stage": stage, "microbatch": mb},
                }
            )
    return write_text_atomic(path_json, json.dumps({"traceEvents": trace,
                                                     "displayTimeUnit": "ms"}))


def format_table(schedule: Schedule, aligned: bool = True, width: int = 4) -> str:
    """One row per rank. `aligned`: place actions on a time grid from a unit-time
    simulation (T_F = T_I = T_W = 1, B = 2, transfers free); '.' is idle. Otherwise
    just the action order. Labels are kind+micro-batch, with a chunk letter (a, b, ...)
    for ranks holding several stages (a = the rank's lowest stage)."""
    chunk = {}
    for r in range(schedule.pp):
        for i, s in enumerate(schedule.stages_on(r)):
            chunk[s] = "abcdefgh"[i] if len(schedule.stages_on(r)) > 1 else ""

    def label(kind: str, stage: int, mb: int) -> str:
        return f"{kind}{mb}{chunk[stage]}"

    rows: list[list[str]] = []
    if aligned:
        res = simulate(schedule, Durations(1.0, 1.0, 1.0))
        slots = int(round(res.step_time))
        for events in res.events:
            row = ["."] * slots
            for kind, stage, mb, start, end in events:
                for t in range(int(round(start)), int(round(end))):
                    row[t] = label(kind, stage, mb)
            rows.append(row)
    else:
        rows = [[str(a) for a in acts] for acts in schedule.actions]
    w = max([width] + [len(c) + 1 for row in rows for c in row])
    s = schedule
    out = [f"{s.name}  pp={s.pp} m={s.microbatches} v={s.virtual_stages}"
           + ("  (time grid: F=I=W=1, B=2)" if aligned else "")]
    for r, row in enumerate(rows):
        out.append(f"rank {r}: " + "".join(c.ljust(w) for c in row).rstrip())
    return "\n".join(out)
