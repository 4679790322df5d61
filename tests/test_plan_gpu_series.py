"""The direction of change with the GPU count: benchmarks/plan_gpu_error.py's scaling
series (tokens/s per GPU, measured against predicted) and Llama 3 405B's 8K -> 16K MFU."""

import json
import sys
from pathlib import Path

import pytest
from helpers import plan_cli as plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plan_gpu_error as script  # noqa: E402


def test_direction_counts_changes_within_the_flat_band_as_flat():
    assert script.direction(0.009) == 0 and script.direction(-0.01) == 0
    assert script.direction(-0.011) == -1 and script.direction(0.02) == 1


def test_series_rows_score_each_step_of_gpu_count():
    sr = script.Series("tiny", "h100-sxm", script.mpt(2, 256, 2),
                       ((8, 64, 8, 1000.0), (16, 128, 8, 900.0)), "a source")
    (row,) = script.series_rows([sr])
    assert row[:3] == ("tiny", "8 -> 16", "-10.0 %")
    predicted = float(row[3].split()[0]) / 100
    assert row[4] == (script.direction(predicted) == -1)


@pytest.mark.parametrize("sr", script.SCALING_SERIES, ids=lambda s: s.name)
def test_series_points_are_whole_accumulation_steps(sr):
    """Each transcribed row: global batch = GPUs x micro-batch x a whole number of
    accumulation steps, GPU counts ascending."""
    counts = [n for n, *_ in sr.points]
    assert counts == sorted(counts) and len(counts) >= 2
    for n, batch, mbs, _ in sr.points:
        assert batch % (n * mbs) == 0


@pytest.mark.parametrize("schedule", [("--first-stage-layers", "7", "--last-stage-layers", "7"),
                                      ("--schedule", "interleaved", "--virtual-stages", "4")],
                         ids=["1f1b-uneven", "interleaved-v4"])
def test_llama3_405b_mfu_falls_from_8k_to_16k_gpus(schedule):
    """The same 16M-token batch on twice the replicas: each pipeline runs half the
    micro-batches, its bubble a larger share, so the MFU falls (the direction Meta
    measured going from 8,192 to 16,384 H100s with tp 8, pp 16)."""
    mfu = {}
    for gpus, dp in ((8192, 64), (16384, 128)):
        rc, out = plan("--model", "llama3-405b", "--gpu", "h100-sxm", "--gpus", str(gpus),
                       "--global-batch", "2048", "--seq-len", "8192", "--layout",
                       f"tp=8,pp=16,dp={dp}", *schedule, "--json")
        assert rc == 0, out
        mfu[gpus] = json.loads(out)["layouts"][0]["mfu"]
    assert mfu[16384] < mfu[8192]
