"""Every parity bound in plait.testing.PARITY_TOLERANCES is the one docs/parity.md states,
and sits between the worst error measured over the layouts it covers and 3x that error
(the table `python tests/measure_tolerances.py` writes from a run of every parity test)."""

from __future__ import annotations

from measure_tolerances import BEGIN, DOC, END, MAX_HEADROOM

from plait.testing import PARITY_TOLERANCES


def _doc_rows() -> dict[tuple[str, str], tuple[str, float]]:
    text = DOC.read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    rows = {}
    for line in text.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[(cells[0], cells[1])] = (cells[2], float(cells[3]))
    return rows


def test_every_bound_is_the_documented_one_within_3x_of_the_worst_measured():
    rows = _doc_rows()
    bounds = {(c, k): b for c, tol in PARITY_TOLERANCES.items() for k, b in tol.items()
              if b is not None}
    assert set(rows) == set(bounds), set(rows) ^ set(bounds)
    for (cls, key), bound in bounds.items():
        written, worst = rows[(cls, key)]
        assert f"{bound:.1e}" == written, (cls, key, bound, written)
        assert worst <= bound <= MAX_HEADROOM * worst or bound == worst == 0, (
            cls, key, bound, worst)
