"""The efficiency constants are re-derived from the calibration set, and the calibration
runs' iteration times are predicted within 10 %."""

import numpy as np
import pytest

from plait.plan.calibration import EFFICIENCY, errors, fit, load_runs


def test_constants_rederived_from_calibration_set():
    fitted = fit()
    for name in ("gemm_max", "gemm_half", "link_efficiency", "elementwise_passes"):
        assert getattr(fitted, name) == pytest.approx(getattr(EFFICIENCY, name), rel=2e-3), name


def test_calibration_runs_within_10_percent(capsys):
    rows = errors()
    assert len(rows) == 8
    with capsys.disabled():
        print()
        for r in rows:
            print(f"  {r['run']:<24} measured {r['measured_s']:7.2f} s  predicted "
                  f"{r['predicted_s']:7.2f} s  {100 * r['error']:+5.1f} %")
        print(f"  mean |error| {100 * np.mean([abs(r['error']) for r in rows]):.1f} %")
    for r in rows:
        assert abs(r["error"]) < 0.10, r


def test_recompute_costs_time():
    runs = load_runs()
    by = {r.name: r for r in runs}
    rows = {r["run"]: r["predicted_s"] for r in errors(runs=runs)}
    for name in by:
        if name.endswith("full"):
            assert rows[name] > rows[name.replace("full", "selective")]
