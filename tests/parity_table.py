"""Regenerate the parity matrix's table in docs/parity.md (issue 16).

    .venv/bin/python tests/parity_table.py          # every row (~4 min on 2 cores)

Runs every row of tests/matrix.py as tests/test_matrix.py does (the same functions),
measures each check's largest error against the single-process run, and rewrites the
part of docs/parity.md between the two `matrix` markers: one line per row, then the
pairs of levels no valid layout has, each with the reason `Config.validate` gives.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_matrix as T  # noqa: E402
from helpers import config, initial_params  # noqa: E402
from matrix import FACTORS, ROWS, STEPS, coverable_pairs, parse, validity  # noqa: E402

from plait.plan.eager import not_covered  # noqa: E402
from plait.testing import PARITY_TOLERANCES, merge_ranks  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "parity.md"
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


def errors(row: str) -> dict[str, float]:
    """The row's largest relative loss and grad-norm errors, first-gradient error (of each
    tensor's largest element) and parameter error (absolute, or movement ratio in bf16)."""
    run, ref = merge_ranks(T.row_run(row)), T.row_reference(row)
    out = {"loss": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref.losses,
                                                          strict=True)),
           "norm": max(abs(a - b) / abs(b) for a, b in zip(run["grad_norms"],
                                                          ref.grad_norms, strict=True)),
           "grad": max(float((run["first_grads"][n] - g).abs().max() / g.abs().max())
                       for n, g in ref.first_grads.items())}
    if "param_atol" in PARITY_TOLERANCES[T.precision_of(row)]:
        out["param"] = max(float((run["params"][n] - p).abs().max())
                           for n, p in ref.params.items())
    else:
        init = initial_params(*parse(row)["model"], f"train.steps={STEPS}")
        out["param"] = max(float((run["params"][n] - p).norm() / (p - init[n]).norm())
                           for n, p in ref.params.items())
    return out


def memory_cell(row: str) -> str:
    why = not_covered(config(*T.row_sets(row)))
    if why is not None:  # its first clause: what it does not follow
        return "refused: " + why.split(";")[0]
    return "within 5 %"


def table() -> list[str]:
    lines = ["| # | layout | world | tolerance | loss | grad norm | first grads | params | "
             "memory vs eager model |", "|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(ROWS, 1):
        e = errors(row)
        prec = T.precision_of(row)
        world = config(*T.row_sets(row)).parallel.world_size
        grad = "not compared" if PARITY_TOLERANCES[prec].get("grad_rtol") is None else \
            f"{e['grad']:.1e}"
        param = f"{e['param']:.1e}" + (" (movement)" if prec.startswith("bf16") else "")
        lines.append(f"| {i} | `{row}` | {world} | {prec} | {e['loss']:.1e} | "
                     f"{e['norm']:.1e} | {grad} | {param} | {memory_cell(row)} |")
    return lines


def refused_pairs() -> list[str]:
    """Every pair of levels no valid layout has, with the reasons of the layout having it
    that `validity` finds the fewest problems with (the pair's own reason, mostly)."""
    from matrix import all_layouts, row_of

    rows = [(lv, row_of(lv, s)) for lv, s in all_layouts()]
    every = [(lv, r, validity(r)) for lv, r in rows]
    covered = coverable_pairs(r for _, r, p in every if not p)
    names = list(FACTORS)
    out = ["| levels | refused because (the layout with them closest to valid) |",
           "|---|---|"]
    for a, b in itertools.combinations(names, 2):
        for la, lb in itertools.product(FACTORS[a], FACTORS[b]):
            if (la, lb) in covered:
                continue
            probs = min((p for lv, _, p in every if lv[a] == la and lv[b] == lb), key=len,
                        default=["every layout with them has a world size > 8 (this "
                                 "machine's limit for the suite)"])
            out.append(f"| {la} + {lb} | {'; '.join(probs).replace('|', '/')} |")
    return out


def main() -> int:
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    body = ["", f"{len(ROWS)} layouts, {STEPS} steps each (python tests/parity_table.py).", "",
            *table(), "", "Pairs of levels that no valid layout at world <= 8 has:", "",
            *refused_pairs(), ""]
    DOC.write_text(head + BEGIN + "\n".join(body) + END + tail)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
