"""The pictures of a run (`plait report --html / --png-dir`): PNG bytes drawn with
matplotlib (Agg: files only, no display) from a metrics file's rows and summary and
`plait report`'s comparison (plait/observe/report.py, `compare`): nothing here measures
or predicts anything itself.

`figures` returns the PNGs by name, in the report's order, and for each figure it could
not draw the reason (a run without a plan, a run with pp = 1, no memory step...).
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

# every figure, in the order the report shows them
FIGURES = ("loss", "throughput", "memory", "communication", "overlap", "bubble", "timeline")
PREDICTED, MEASURED = "#4c8bf5", "#f5a623"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    _pyplot().close(fig)
    return buf.getvalue()


def _unit(largest: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return scale, name
    return 1.0, "B"


def _curves(rows: list[dict], left: tuple[str, str], right: tuple[str, str],
            scale_right: float = 1.0) -> bytes:
    """Two per-step curves side by side: (row key, axis label) each."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, (key, label), scale in zip(axes, (left, right), (1.0, scale_right)):
        ax.plot(steps, [r[key] * scale for r in rows], marker="o", markersize=3)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    return _png(fig)


def _paired_bars(labels: list[str], predicted: list[float | None], measured: list[float],
                 title: str, ylabel: str) -> bytes:
    """Predicted beside measured, one pair per label (a missing prediction: no bar)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels) + 2), 3.4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [p or 0.0 for p in predicted], 0.4, label="planner",
           color=PREDICTED)
    ax.bar([x + 0.2 for x in xs], measured, 0.4, label="measured", color=MEASURED)
    ax.set_xticks(list(xs), labels, rotation=15 if len(labels) > 5 else 0)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def memory_figure(memory: dict) -> bytes:
    cats = memory["categories"]
    scale, unit = _unit(max(max(c["predicted"], c["measured"]) for c in cats))
    return _paired_bars([c["category"] for c in cats], [c["predicted"] / scale for c in cats],
                        [c["measured"] / scale for c in cats],
                        f"memory by category, rank 0, step {memory['step']}", unit)


def communication_figure(dims: list[dict]) -> bytes:
    scale, unit = _unit(max(max(d["predicted_bytes"], d["measured_bytes"]) for d in dims))
    return _paired_bars([d["dim"] for d in dims], [d["predicted_bytes"] / scale for d in dims],
                        [d["measured_bytes"] / scale for d in dims],
                        "payload bytes per step per mesh dim, rank 0", f"{unit} per step")


def overlap_figure(dims: list[dict]) -> bytes:
    return _paired_bars([d["dim"] for d in dims], [d["predicted_exposed_share"] for d in dims],
                        [d["measured_exposed_share"] or 0.0 for d in dims],
                        "exposed share of each dim's communication time",
                        "exposed / time in flight")


# the summary's bubbles a report shows (plait/parallel/pipeline/measure.py defines them)
BUBBLES = (("measured, mean of the steps", "measured_bubble"),
           ("simulated, measured durations", "simulated_bubble"),
           ("simulated, free transfers", "simulated_bubble_no_comm"),
           ("simulated, CPU times", "simulated_bubble_cpu"))


def bubbles(summary: dict) -> list[tuple[str, float]]:
    """(name, fraction) of each bubble the report's table and figure show, one list for
    both: the summary's, then the last step's, the one the timeline draws (and titles)."""
    from plait.parallel.pipeline.measure import last_step_bubble

    p = summary["pipeline"]
    out = [(name, p[key]) for name, key in BUBBLES if key in p]
    if summary.get("pipeline_timeline"):
        out.insert(1, ("measured, last step (the timeline)",
                       last_step_bubble(summary["pipeline_timeline"])))
    return out


def bubble_figure(summary: dict) -> bytes:
    plt = _pyplot()
    pipeline = summary["pipeline"]
    shown = bubbles(summary)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.bar([name.replace(", ", ",\n") for name, _ in shown], [100 * v for _, v in shown],
           color=[MEASURED if name.startswith("measured") else PREDICTED for name, _ in shown])
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("bubble, % of pp x span")
    ax.set_title(f"pipeline {pipeline['schedule']} pp={pipeline['pp']} "
                 f"m={pipeline['microbatches']} v={pipeline['virtual_stages']}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def timeline_figure(pipeline: dict, events: list[list]) -> bytes:
    """The last step's measured computes, drawn as `plait train --timeline` draws them."""
    from plait.parallel.pipeline.measure import draw_measured
    from plait.schedule.registry import build_schedule

    schedule = build_schedule(pipeline["schedule"], pipeline["pp"], pipeline["microbatches"],
                              pipeline["virtual_stages"])
    with tempfile.TemporaryDirectory() as d:
        path = draw_measured(events, schedule, Path(d) / "timeline.png")
        return path.read_bytes()


def figures(rows: list[dict], summary: dict, rep: dict | None, no_plan: str | None
            ) -> tuple[dict[str, bytes], dict[str, str]]:
    """(PNG bytes by figure name, the reason for each figure not drawn). `rep`: the
    comparison (`compare`), or None with `no_plan` saying why there is none."""
    out: dict[str, bytes] = {}
    why: dict[str, str] = {}
    out["loss"] = _curves(rows, ("loss", "loss (global batch mean)"),
                          ("grad_norm", "grad norm (before clipping)"))
    out["throughput"] = _curves(rows, ("tokens_per_s", "tokens/s"),
                                ("step_time", "step time, ms"), scale_right=1e3)
    if rep is None:
        for name in ("memory", "communication", "overlap"):
            why[name] = no_plan or "no comparison"
    else:
        if rep.get("memory"):
            out["memory"] = memory_figure(rep["memory"])
        else:
            why["memory"] = rep.get("memory_missing") or "no memory comparison"
        dims = rep.get("communication") or []
        if dims and any(d["predicted_bytes"] or d["measured_bytes"] for d in dims):
            out["communication"] = communication_figure(dims)
        else:
            why["communication"] = "no collectives, predicted or measured"
        if any(d["measured_exposed_share"] is not None for d in dims):
            out["overlap"] = overlap_figure(dims)
        else:
            why["overlap"] = "no collective with measured time"
    pipeline = summary.get("pipeline")
    if pipeline:
        out["bubble"] = bubble_figure(summary)
    else:
        why["bubble"] = "pp=1: the run has no pipeline, so no bubble"
    if pipeline and summary.get("pipeline_timeline"):
        out["timeline"] = timeline_figure(pipeline, summary["pipeline_timeline"])
    else:
        why["timeline"] = ("the summary holds no timeline (written by plait train for "
                           "pp > 1)" if pipeline else "pp=1: the run has no pipeline")
    return out, why
