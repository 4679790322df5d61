"""A step's measured timeline, every layout: a Chrome trace (Perfetto) and a PNG.

The data is `plait.train.timeline.gather_timeline`'s: per rank, the runtime's actions,
the units' forward / backward / recompute spans, the loop's phases and the ledger's
collectives. Both pictures show, per rank, three rows:

  step   the runtime's actions (F, B, I, W per stage and micro-batch; without pipelining,
         F and B per micro-batch) and the loop's phases after them (gradient sync,
         grad norm, optimizer, metrics)
  units  each unit's forward (F), backward (B; BR, hatched, when it holds the block's
         recomputation) and recomputed forward (R, the I/W split's), by name
  comm   each collective from issue to completion, its blocked part (the rank waited:
         exposed) distinguishable from the part in flight behind other work (hidden)

In the trace a collective is one slice named "op dim" with its tag, payload, bytes sent,
group size, blocked and hidden milliseconds as arguments, and its blocked part a child
slice "wait"; collectives in flight together go on separate lanes ("comm 0", "comm 1",
...). In the PNG a collective's whole flight is a pale strip at the foot of the comm row and its
blocked part a solid bar of the row's height, both in the dim's colour.
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.dims import DIMENSIONS, REPLICAS
from plait.files import write_png, write_text_atomic

ACTION_COLORS = {"F": "#4c8bf5", "B": "#f5a623", "I": "#e8603c", "W": "#57b85a"}
UNIT_COLORS = {"F": "#4c8bf5", "B": "#f5a623", "BR": "#f5a623", "R": "#9b59b6"}
UNIT_CATEGORIES = {"F": "forward", "B": "backward", "BR": "backward", "R": "recompute"}
PHASE_COLORS = {"gradient sync": "#7f8c8d", "grad norm": "#bdc3c7", "optimizer": "#2ecc71",
                "metrics": "#d5dbdb"}
# each dimension's own colour (plait/dims/), and the groups that are not one dimension's
DIM_COLORS = {**{d.name: d.color for d in DIMENSIONS}, "edp": "#e377c2", REPLICAS: "#2ca02c",
              "world": "#7f7f7f"}
RUNTIME_PHASE = "micro-batches"  # its actions are drawn instead
_US = 1e6  # the trace's unit: microseconds


def rank_label(rec: dict) -> str:
    coords = " ".join(f"{d}{c}" for d, c in rec["coords"].items())
    return f"rank {rec['rank']}" + (f" ({coords})" if coords else "")


def comm_lanes(comms: list[dict]) -> list[int]:
    """A lane per collective, the first free at its issue: overlapping ones never share."""
    ends: list[float] = []
    lanes = []
    for c in sorted(range(len(comms)), key=lambda i: comms[i]["start"]):
        lane = next((k for k, e in enumerate(ends) if e <= comms[c]["start"]), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = comms[c]["end"]
        lanes.append((c, lane))
    return [lane for _, lane in sorted(lanes)]


def _slice(name: str, cat: str, pid: int, tid: int, start: float, end: float,
           args: dict | None = None) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": start * _US,
            "dur": max(end - start, 0.0) * _US, "args": args or {}}


def _meta(kind: str, pid: int, tid: int | None = None, **args: object) -> dict:
    row = {"name": kind, "ph": "M", "pid": pid, "args": args}
    return row if tid is None else {**row, "tid": tid}


def trace_events(timeline: dict) -> list[dict]:
    """The Chrome trace's events: a process per rank; threads step (0), units (1) and
    comm lanes (2, 3, ...)."""
    out = []
    for rec in timeline["ranks"]:
        pid = rec["rank"]
        out += [_meta("process_name", pid, name=rank_label(rec)),
                _meta("process_sort_index", pid, sort_index=pid),
                _meta("thread_name", pid, 0, name="step"),
                _meta("thread_name", pid, 1, name="units")]
        for kind, stage, mb, a, b in rec["actions"]:
            out.append(_slice(f"{kind}{stage}.{mb}", f"action.{kind}", pid, 0, a, b,
                              {"stage": stage, "microbatch": mb}))
        for stage, mb, a, b in rec["recompute"]:
            out.append(_slice(f"R{stage}.{mb}", "action.R", pid, 0, a, b,
                              {"stage": stage, "microbatch": mb}))
        out += [_slice(name, "phase", pid, 0, a, b) for name, a, b in rec["phases"]
                if name != RUNTIME_PHASE]
        out += [_slice(f"{kind} {name}", UNIT_CATEGORIES[kind], pid, 1, a, b,
                       {"unit": name, "stage": stage, "recomputed": kind == "BR"})
                for kind, name, stage, a, b in rec["units"]]
        lanes = comm_lanes(rec["comm"])
        for lane in sorted(set(lanes)):
            out.append(_meta("thread_name", pid, 2 + lane, name=f"comm {lane}"))
        for c, lane in zip(rec["comm"], lanes, strict=True):
            hidden = max(c["end"] - c["start"] - c["blocked"], 0.0)
            args = {"op": c["op"], "dim": c["dim"], "tag": c["tag"], "payload_bytes": c["payload"],
                    "sent_bytes": c["sent"], "group_size": c["group_size"],
                    "blocked_ms": c["blocked"] * 1e3, "hidden_ms": hidden * 1e3}
            out.append(_slice(f"{c['op']} {c['dim']}", "comm", pid, 2 + lane, c["start"],
                              c["end"], args))
            if c["blocked"] > 0:
                out.append(_slice("wait", "comm.blocked", pid, 2 + lane,
                                  max(c["end"] - c["blocked"], c["start"]), c["end"],
                                  {"op": c["op"], "dim": c["dim"]}))
    return out


def write_chrome_trace(timeline: dict, path: str | Path) -> Path:
    """The trace as one JSON file (open it in https://ui.perfetto.dev or chrome://tracing),
    written whole or not at all."""
    doc = {"traceEvents": trace_events(timeline), "displayTimeUnit": "ms",
           "otherData": {"layout": timeline["layout"], "step": timeline["step"]}}
    return write_text_atomic(path, json.dumps(doc))


def draw_step_timeline(timeline: dict, path: str | Path) -> Path:
    """The PNG: three rows per rank (step, units, comm), readable for 8 ranks and more
    (the figure grows with the ranks). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    ranks = timeline["ranks"]
    span = max(max(r["window"][1] for r in ranks), 1e-9)
    fig, ax = plt.subplots(figsize=(14, 1.1 * len(ranks) + 1.8))
    ticks, labels = [], []
    for i, rec in enumerate(ranks):
        y = 3 * i
        _draw_rank(ax, rec, y, span)
        ticks += [y, y + 1, y + 2]
        labels += [f"{rank_label(rec)}  step", "units", "comm"]
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_ylim(3 * len(ranks) - 0.4, -0.6)
    ax.set_xlim(0, span * 1e3)
    ax.set_xlabel("ms from the first rank's start of the step")
    ax.set_title(f"{timeline['layout'].split(' (')[0]}: step {timeline['step']}, "
                 f"{span * 1e3:.1f} ms (comm: pale strip in flight, solid bar rank blocked)",
                 fontsize=9)
    ax.legend(handles=_legend(ranks), loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=7, frameon=False)
    fig.tight_layout()
    path = write_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def _bar(ax, y: float, a: float, b: float, color: str, height: float = 0.8, **kw) -> None:
    ax.broken_barh([(a * 1e3, max(b - a, 0.0) * 1e3)], (y - height / 2, height),
                   facecolors=color, **kw)


def _label(ax, y: float, a: float, b: float, text: str, span: float) -> None:
    if b - a > 0.04 * span:  # only where it fits
        ax.text((a + b) / 2 * 1e3, y, text, ha="center", va="center", fontsize=6,
                clip_on=True)


def _draw_rank(ax, rec: dict, y: float, span: float) -> None:
    for kind, stage, mb, a, b in rec["actions"]:
        _bar(ax, y, a, b, ACTION_COLORS.get(kind, "#999999"), edgecolor="black", linewidth=0.3)
        _label(ax, y, a, b, f"{kind}{stage}.{mb}", span)
    for _stage, _mb, a, b in rec["recompute"]:
        _bar(ax, y + 0.3, a, b, UNIT_COLORS["R"], height=0.2)
    for name, a, b in rec["phases"]:
        if name != RUNTIME_PHASE:
            _bar(ax, y, a, b, PHASE_COLORS.get(name, "#cccccc"), edgecolor="black",
                 linewidth=0.3)
            _label(ax, y, a, b, name, span)
    for kind, name, _stage, a, b in rec["units"]:
        _bar(ax, y + 1, a, b, UNIT_COLORS[kind], edgecolor="black", linewidth=0.2,
             hatch="///" if kind == "BR" else None)
        _label(ax, y + 1, a, b, name.removeprefix("layers."), span)
    for c in rec["comm"]:
        color = DIM_COLORS.get(c["dim"], "#333333")
        # in flight: a pale strip along the row's foot; blocked: the row's full height
        _bar(ax, y + 2.25, c["start"], c["end"], color, height=0.3, alpha=0.45)
        _bar(ax, y + 2, max(c["end"] - c["blocked"], c["start"]), c["end"], color)


def _legend(ranks: list[dict]) -> list:
    from matplotlib.patches import Patch

    actions = {k for r in ranks for k, *_ in r["actions"]}
    units = {k for r in ranks for k, *_ in r["units"]}
    phases = {n for r in ranks for n, *_ in r["phases"]} - {RUNTIME_PHASE}
    dims = sorted({c["dim"] for r in ranks for c in r["comm"]})
    unit_names = {"F": "unit forward", "B": "unit backward",
                  "BR": "unit backward + recompute", "R": "unit recompute"}
    return ([Patch(color=ACTION_COLORS[k], label=f"action {k}") for k in ACTION_COLORS
             if k in actions]
            + [Patch(color=PHASE_COLORS[p], label=p) for p in PHASE_COLORS if p in phases]
            + [Patch(facecolor=UNIT_COLORS[k], hatch="///" if k == "BR" else None,
                     label=unit_names[k]) for k in UNIT_COLORS if k in units]
            + [Patch(color=DIM_COLORS.get(d, "#333333"), label=f"comm {d}") for d in dims])
