"""Every parity bound in plait.testing.PARITY_TOLERANCES is the one docs/parity.md states,
set as the table says: a derived bound is epsilon x its stated growth (and at least the
worst error measured on every CPU kernel path), a measured bound (bf16, float8 over bf16)
sits between the worst error over the paths and 3x that error (the table
`python tests/measure_tolerances.py` writes from runs of every parity test under each
`ATEN_CPU_CAPABILITY`)."""

from __future__ import annotations

from measure_tolerances import BEGIN, DOC, END, MAX_HEADROOM, how

from plait.testing import (
    DERIVED_CHECKS,
    DERIVED_CLASSES,
    EPS32,
    EPS64,
    PARAM_GROWTH,
    PARITY_TOLERANCES,
)


def _doc_rows() -> dict[tuple[str, str], tuple[str, str, float]]:
    text = DOC.read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    rows = {}
    for line in text.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[(cells[0], cells[1])] = (cells[2], cells[3], float(cells[4]))
    return rows


def test_every_bound_is_the_documented_one_and_keeps_its_rule():
    rows = _doc_rows()
    bounds = {(c, k): b for c, tol in PARITY_TOLERANCES.items() for k, b in tol.items()}
    assert set(rows) == set(bounds), set(rows) ^ set(bounds)
    for (cls, key), bound in bounds.items():
        written, kind, worst = rows[(cls, key)]
        assert f"{bound:.1e}" == written, (cls, key, bound, written)
        assert kind == how(cls, key), (cls, key, kind)
        if kind == "measured":
            assert worst <= bound <= MAX_HEADROOM * worst or bound == worst == 0, (
                cls, key, bound, worst)
        else:
            assert worst <= bound, (cls, key, bound, worst)


def test_derived_bounds_are_epsilon_times_their_growth():
    assert (EPS64, EPS32) == (2.0 ** -52, 2.0 ** -23)
    for cls, (eps, growth) in DERIVED_CLASSES.items():
        tol = PARITY_TOLERANCES[cls]
        for key in set(DERIVED_CHECKS) & set(tol):
            more = PARAM_GROWTH if key == "param_lr_rtol" else 1
            assert tol[key] == growth * more * eps, (cls, key)
        # identical routing: the balancing biases are equal exactly
        assert tol.get("bias_atol", 0.0) == 0.0
        assert {"loss_rtol", "norm_rtol", "grad_rtol", "param_lr_rtol"} <= set(tol)
    # float64's bounds stay far below what a mutant does (docs/parity.md: the least a
    # mutant moves any check is ~1e-6 relative)
    assert max(PARITY_TOLERANCES["fp64"].values()) < 4e-9
