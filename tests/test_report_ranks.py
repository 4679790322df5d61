"""`plait report` holds rank 0's ledger to rank 0's predictions, and says each number
with what it is of: the pipeline bytes of the first pipeline rank (not of a middle one,
which sends both ways), the bubble of the steps' mean and of the step the timeline draws
(one function for the table, the bar chart and the timeline's title), the exposed
communication time beside the step time.

The ledger below was recorded from `plait train --nproc 4 --pp 4 --microbatches 8 --set
model.n_layers=4 --steps 3` (tiny, fp32, 1f1b; rank 0's summary line, trimmed)."""

from __future__ import annotations

import pytest

from plait.config import load_config
from plait.observe.report import compare, overlap_rows

PP4 = ["parallel.pp=4", "parallel.microbatches=8", "model.n_layers=4"]
RECORDED = {
    "mean_step_time": 0.0683,
    "ledger": {
        "per_step": {
            "send@pp": {"count": 8.0, "payload": 131072.0, "sent": 131072.0},
            "recv@pp": {"count": 8.0, "payload": 131072.0, "received": 131072.0},
            "all_reduce@pp": {"count": 1.0, "payload": 8.0},
            "all_reduce@world": {"count": 1.0, "payload": 8.0}},
        "overlap_per_step": {"pp": {"seconds": 0.389, "exposed": 0.0624, "hidden": 0.3266}},
    },
}


def _dim(rep: dict, dim: str) -> dict:
    return next(d for d in rep["communication"] if d["dim"] == dim)


def test_pipeline_bytes_at_pp4_are_rank_0s_on_both_sides():
    from plait.plan import estimate_config

    cfg = load_config(None, sets=PP4)
    pp = _dim(compare([{"step": 0}], RECORDED, cfg), "pp")
    # rank 0 sends 8 activations (a 64-token sequence x dim 64, fp32: 16 KiB each); it
    # receives the gradients, which the ledger lists but a peer's sends account for
    assert pp["predicted_bytes"] == pytest.approx(131072.0)
    assert pp["ratio"] == pytest.approx(1.0, abs=1e-4)
    assert [x["calls"] for x in pp["predicted"]] == [8]
    # the layout's most loaded rank (the planner's search scores it) is a middle one:
    # activations forward and gradients back, twice rank 0's
    most = sum(float(c.size * c.count) for c in estimate_config(cfg).collectives
               if c.dim == "pp")
    assert most == pytest.approx(2 * 131072.0)


def test_overlap_says_the_exposed_time_beside_the_step():
    cfg = load_config(None, sets=PP4)
    rep = compare([{"step": 0}], RECORDED, cfg)
    assert rep["step_time_s"] == 0.0683
    row = overlap_rows([_dim(rep, "pp")], rep["step_time_s"])[0]
    # exposed 62.4 ms of a 68.3 ms step; in flight 389 ms: the sends overlap each other
    assert row[3:] == ["62.40", "91.4 %", "389.00"]


def test_bubble_table_and_figures_give_one_number_per_definition():
    from plait.observe.figures import bubbles
    from plait.parallel.pipeline.runtime_stats import step_bubble

    # two ranks, the last step: rank 0 busy 0-1 and 2-3 ms, rank 1 busy 1-2 ms: span 3 ms
    events = [[["F", 0, 0, 0.0, 0.001], ["B", 0, 0, 0.002, 0.003]],
              [["F", 1, 0, 0.001, 0.002]]]
    summary = {"pipeline": {"measured_bubble": 0.4, "simulated_bubble": 0.3},
               "pipeline_timeline": events}
    shown = dict(bubbles(summary))
    assert shown["measured, mean of the steps"] == 0.4
    assert shown["simulated, measured durations"] == 0.3
    last = shown["measured, last step (the timeline)"]
    assert last == pytest.approx(0.5)  # 3 ms busy of 2 ranks x 3 ms
    assert last == step_bubble([(0.0, 0.0, [tuple(e) for e in r]) for r in events])[0]


def test_the_timeline_is_drawn_in_ms_titled_with_the_last_steps_bubble(monkeypatch):
    from plait.parallel.pipeline import measure
    from plait.schedule.registry import build_schedule

    drawn = {}
    monkeypatch.setattr(measure, "draw_timeline", lambda result, schedule, path, **kw:
                        drawn.update(result=result, **kw))
    events = [[["F", 0, 0, 0.0, 0.001], ["B", 0, 0, 0.002, 0.003]],
              [["F", 1, 0, 0.001, 0.002], ["B", 1, 0, 0.0015, 0.0016]]]
    measure.draw_measured(events, build_schedule("gpipe", 2, 1, 1), "unused.png")
    assert drawn["unit"] == "ms" and drawn["what"] == "last step"
    assert drawn["result"].step_time == pytest.approx(3.0)  # ms
    assert drawn["result"].bubble_fraction == measure.last_step_bubble(events)


def test_report_plan_says_its_pp_bytes_are_the_most_loaded_ranks(monkeypatch):
    from plait.observe import plan_check

    monkeypatch.setattr(plan_check, "layout_mismatches", lambda plan, cfg: [])  # not here

    cfg = load_config(None, sets=PP4)
    plan = {"layout": {"step_time_s": 0.05, "memory_total_bytes": 1,
                       "collectives": [{"dim": "pp", "bytes": 16384.0, "count": 16}]},
            "hardware": {"gpu": "h100-sxm"}, "config": "run.toml"}
    rep = compare([{"step": 0}], RECORDED, cfg)
    pc = plan_check.compare_plan(plan, cfg, [{"step": 0, "step_time": 0.07}], rep["communication"])
    pp = next(d for d in pc["communication"] if d["dim"] == "pp")
    assert pp["plan_rank"] == "most loaded" and pp["ratio"] == pytest.approx(2.0, abs=1e-3)
