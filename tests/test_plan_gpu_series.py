"""benchmarks/plan_gpu_error.py's scaling series: the direction of change of tokens/s per
GPU with the GPU count, measured against predicted."""

import sys
from pathlib import Path

import pytest

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
