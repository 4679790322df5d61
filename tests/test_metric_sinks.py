"""`plait train --tensorboard DIR --wandb PROJECT`: what the sinks hold, read back with
tensorboard's EventAccumulator and from the offline W&B run's log (tests/sink_readers.py),
equals the `--metrics-out` JSON lines, number for number.

One real run through the CLI (tests/conftest.py, pipeline_cli_run: torchrun, 2 ranks,
pp=2 so the summary has a bubble, the memory step measured): a sink is written by rank 0
of a launched job, so only a launched job shows that only rank 0 writes. Exact equality
is the right tolerance: the sinks get the very floats the JSON is written from,
TensorBoard as float64 tensors, W&B as JSON.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CLI_STEPS
from sink_readers import tensorboard_scalars, wandb_offline_run

# the run they read is `plait train` through torchrun (tests/conftest.py, pipeline_cli_run)
pytestmark = pytest.mark.slow

pytest.importorskip("tensorboard", reason="the tensorboard sink needs plait[tensorboard]")
pytest.importorskip("wandb", reason="the W&B sink needs plait[wandb]")

STEPS = CLI_STEPS
NAMED = ("loss", "grad_norm", "lr", "tokens_per_s", "step_time", "tokens", "comm_sent_bytes",
         "compute_s", "wait_s")


@pytest.fixture(scope="module")
def run(pipeline_cli_run) -> dict:
    return {**pipeline_cli_run, "rows": pipeline_cli_run["metrics"]}


def _expected(rows: list[dict]) -> dict[str, dict[int, float]]:
    """What the JSON says each named scalar was, by tag and step (the test's own reading
    of the rows, not plait's flattening)."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        s = row["step"]
        for key in NAMED:
            out.setdefault(key, {})[s] = row[key]
        for dim, sent in row["comm_sent_bytes_by_dim"].items():
            out.setdefault(f"comm_sent_bytes_by_dim/{dim}", {})[s] = sent
        for phase in ("peak", "pre_optimizer"):
            for cat, n in row.get("memory", {}).get(phase, {}).items():
                out.setdefault(f"memory/{phase}/{cat}", {})[s] = n
        if "memory" in row:
            out.setdefault("memory/peak_total", {})[s] = row["memory"]["peak_total"]
    return out


def test_tensorboard_scalars_equal_the_json(run):
    rows, summary = run["rows"], run["summary"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows[1]["comm_sent_bytes_by_dim"]["pp"] > 0 and "memory" in rows[1]
    events = list((run["dir"] / "tb").iterdir())
    assert len(events) == 1, events  # rank 0 only
    tb = tensorboard_scalars(run["dir"] / "tb")
    for tag, by_step in _expected(rows).items():
        assert tb[tag] == by_step, tag
    # the dims sum to the total the row gives
    for r in rows:
        assert sum(r["comm_sent_bytes_by_dim"].values()) == r["comm_sent_bytes"]
    last = rows[-1]["step"]
    for key in ("measured_bubble", "simulated_bubble", "simulated_bubble_no_comm"):
        assert tb[f"summary/pipeline/{key}"] == {last: summary["pipeline"][key]}, key
    assert tb["summary/tokens_per_s"] == {last: summary["tokens_per_s"]}
    for dim, row in summary["ledger"]["overlap_per_step"].items():
        assert tb[f"summary/ledger/overlap_per_step/{dim}/exposed"] == {last: row["exposed"]}
    # nothing else: every tag is a number of a row or of the summary
    named = set(_expected(rows)) | {t for t in tb if t.startswith("summary/")}
    assert set(tb) == named, set(tb) ^ named


def test_wandb_offline_run_equals_the_json(run):
    rows, summary = run["rows"], run["summary"]
    runs = list((run["dir"] / "wb" / "wandb").glob("*run-*"))
    assert len(runs) == 1 and runs[0].name.startswith("offline-run-"), runs  # rank 0, offline
    wb = wandb_offline_run(run["dir"] / "wb")
    assert sorted(wb["history"]) == list(range(STEPS))
    for tag, by_step in _expected(rows).items():
        for step, value in by_step.items():
            assert wb["history"][step][tag] == value, (tag, step)
    for key in ("measured_bubble", "simulated_bubble"):
        assert wb["summary"][f"summary/pipeline/{key}"] == summary["pipeline"][key]
    assert wb["summary"]["summary/tokens_per_s"] == summary["tokens_per_s"]
    for section in ("model", "parallel", "train"):  # the run's configuration, as recorded
        assert wb["config"][section] == summary["config"][section], section


def test_the_metrics_file_completes_beside_the_sinks(run):
    """The JSON lines still carry exactly the keys of a run without sinks (plus the
    per-dim bytes every run now writes)."""
    keys = set(run["rows"][0])
    assert {*NAMED, "step", "comm_sent_bytes_by_dim"} <= keys
    assert not Path(str(run["dir"] / "m.jsonl") + ".partial").exists()
