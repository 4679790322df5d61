"""`plait report --plan run.plan.json`: a run beside the plan that `plait plan
--emit-config` wrote for it (plait/plan/emit.py).

Three things are compared: that the run is the planned layout (sizes, ZeRO, schedule,
micro-batches, batch, sequence, model shape); the step time the plan predicted for its
hardware against the run's (mean of the timed steps: the first, warm-up, left out when
there are others, as plait/throughput.py does; their median and the fastest beside it);
and per mesh dim the plan's collective payload bytes per step against the run's ledger
(the comparison `plait report` already makes from the run's config, here from the plan
file itself). The plan's memory is the
fused-kernel GPU model; beside a CPU run's measured peak it is shown, not judged: the
eager prediction above is the one to hold a CPU run to.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from plait.config import Config
from plait.dims import DIMENSIONS


def read_plan(path: str | Path) -> dict[str, Any]:
    """The plan file; ValueError names what is wrong with it."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--plan {path} is not a plan file plait plan --emit-config wrote "
                         f"({e})") from None
    keys = ("layout", "shape", "hardware", "global_batch")
    if not isinstance(doc, dict) or any(k not in doc for k in keys):
        raise ValueError(f"--plan {path} has no layout: give the .plan.json that plait plan "
                         "--emit-config wrote beside the config")
    return doc


def layout_mismatches(plan: dict[str, Any], cfg: Config) -> list[str]:
    """Where the run's configuration is not the planned one."""
    lay, shape, p, m = plan["layout"], plan["shape"], cfg.parallel, cfg.model
    pairs = [(f"{k}", lay["layout"][k], getattr(p, k)) for k in (d.name for d in DIMENSIONS)]
    pairs += [("zero", lay["zero"], p.zero), ("microbatches", lay["microbatches"],
                                              cfg.microbatches()),
              ("global_batch", plan["global_batch"], cfg.train.global_batch),
              ("seq_len", shape["seq"], cfg.train.seq_len),
              ("layers", shape["layers"], m.n_layers), ("hidden", shape["hidden"], m.dim),
              ("heads", shape["heads"], m.n_heads), ("kv_heads", shape["kv_heads"],
                                                      m.n_kv_heads),
              ("ffn", shape["ffn"], m.ffn_dim), ("vocab", shape["vocab"], m.vocab_size),
              ("experts", shape["experts"], m.n_experts)]
    if p.pp > 1:
        pairs.append(("schedule", lay["schedule"], p.schedule))
    return [f"{k}: planned {want}, run {got}" for k, want, got in pairs if want != got]


def _timed(rows: list[dict]) -> list[float]:
    times = [float(r["step_time"]) for r in rows if "step_time" in r]
    return times[1:] if len(times) > 1 else times


def measured_step_time(rows: list[dict]) -> float | None:
    timed = _timed(rows)
    return sum(timed) / len(timed) if timed else None


def compare_plan(plan: dict[str, Any], cfg: Config, rows: list[dict],
                 communication: list[dict] | None) -> dict[str, Any]:
    """The run against its plan, as data."""
    lay = plan["layout"]
    measured = measured_step_time(rows)
    predicted = float(lay["step_time_s"])
    planned_dims: dict[str, float] = {}
    for c in lay["collectives"]:
        planned_dims[c["dim"]] = planned_dims.get(c["dim"], 0.0) + c["bytes"] * c["count"]
    ledger = {d["dim"]: d["measured_bytes"] for d in communication or []}
    dims = [{"dim": d, "planned_bytes": planned_dims.get(d), "measured_bytes": ledger.get(d),
             "ratio": planned_dims[d] / ledger[d] if planned_dims.get(d) and ledger.get(d)
             else None} for d in sorted(set(planned_dims) | set(ledger))]
    mem_row = next((r for r in rows if "memory" in r), None)
    # the plan's collectives are its most loaded rank's: at pp >= 3 a middle pipeline
    # rank, sending both ways (twice rank 0's pp bytes); `compare` holds rank 0 to rank 0
    for d in dims:
        d["plan_rank"] = "most loaded" if d["dim"] == "pp" and cfg.parallel.pp >= 3 else None
    return {"plan": plan.get("config"), "hardware": plan["hardware"]["gpu"],
            "mismatches": layout_mismatches(plan, cfg),
            # the fastest timed step too: on a shared machine the least disturbed one, the
            # estimator plait calibrate's profile uses (best of repeats)
            "step_time": {"predicted_s": predicted, "measured_s": measured,
                          "measured_min_s": min(_timed(rows), default=None),
                          # the median: robust to a few disturbed steps either way
                          "measured_median_s": statistics.median(_timed(rows))
                          if _timed(rows) else None,
                          "ratio": predicted / measured if measured else None},
            "communication": dims,
            "memory": {"planned_total_bytes": lay["memory_total_bytes"],
                       "measured_peak_bytes": mem_row["memory"]["peak_total"]
                       if mem_row else None}}


def print_plan_check(console: Any, pc: dict[str, Any]) -> None:
    from rich.table import Table

    st = pc["step_time"]
    t = Table(title=f"the run against its plan ({pc['plan']}, planned for {pc['hardware']})")
    for col in ("quantity", "plan", "run", "plan / run"):
        t.add_column(col, justify="left" if col == "quantity" else "right")

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    t.add_row("step time s (run: mean of the timed steps)", f"{st['predicted_s']:.4g}",
              "-" if st["measured_s"] is None else f"{st['measured_s']:.4g}",
              ratio(st["ratio"]))
    for key, what in (("measured_median_s", "the median step"),
                      ("measured_min_s", "the fastest step")):
        if st.get(key):
            t.add_row(f"step time s (run: {what})", f"{st['predicted_s']:.4g}",
                      f"{st[key]:.4g}", ratio(st["predicted_s"] / st[key]))
    for d in pc["communication"]:
        which = " (plan: its most loaded rank, a middle one; run: rank 0)" \
            if d.get("plan_rank") else ""
        t.add_row(f"{d['dim']} bytes/step{which}", f"{d['planned_bytes'] or 0:,.0f}",
                  f"{d['measured_bytes'] or 0:,.0f}", ratio(d["ratio"]))
    mem = pc["memory"]
    t.add_row("memory, peak rank (plan: fused GPU kernels)",
              f"{mem['planned_total_bytes']:,.0f}",
              "-" if mem["measured_peak_bytes"] is None else f"{mem['measured_peak_bytes']:,.0f}",
              "-")
    console.print(t)
    for m in pc["mismatches"]:
        console.print(f"note: the run is not the planned layout: {m}")
    if not pc["mismatches"]:
        console.print("the run is the planned layout (sizes, ZeRO, schedule, micro-batches, "
                      "batch, sequence, model shape).")
