"""One tokens/s definition (plait/throughput.py), used by the run's rows and summary and
by the planner: the global batch's tokens per step over the step times, the first step
left out when there are others."""

import pytest
from helpers import batches_for, config

from plait.mesh import ParallelMesh
from plait.throughput import mean_step_time, timed_steps, tokens_per_second, tokens_per_step
from plait.train.loop import train


def test_the_definition():
    assert tokens_per_step(8, 32) == 256
    assert timed_steps([9.0, 1.0, 3.0]) == [1.0, 3.0]  # the warm-up step left out
    assert timed_steps([9.0]) == [9.0]  # unless it is the only one
    # the steps' tokens over their time, not the mean of per-step rates
    assert tokens_per_second(100, [9.0, 1.0, 3.0]) == pytest.approx(200 / 4.0)
    assert mean_step_time([9.0, 1.0, 3.0]) == 2.0
    assert mean_step_time([9.0, 1.0, 3.0], warmup=2) == 3.0
    assert tokens_per_second(100, []) is None and mean_step_time([]) is None


def test_a_runs_rows_and_summary_use_it():
    cfg = config()
    result = train(cfg, ParallelMesh.build(cfg.parallel), batches_for(cfg))
    tokens = tokens_per_step(cfg.train.global_batch, cfg.train.seq_len)
    times = [m["step_time"] for m in result.metrics]
    for m in result.metrics:
        assert m["tokens"] == tokens == cfg.train.global_batch * cfg.train.seq_len
        assert m["tokens_per_s"] == pytest.approx(tokens / m["step_time"], rel=1e-12)
    # the summary leaves the first (warm-up) step out, and divides tokens by time
    timed = times[1:]
    assert result.summary["tokens_per_s"] == pytest.approx(
        tokens * len(timed) / sum(timed), rel=1e-12)
    assert result.summary["mean_step_time"] == pytest.approx(sum(timed) / len(timed), rel=1e-12)
