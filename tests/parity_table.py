"""Regenerate the parity matrix's table in docs/parity_matrix.md.

    .venv/bin/python tests/parity_table.py          # every row (~4 min on 2 cores)

Runs every row of tests/matrix.py as tests/test_matrix.py does (the same functions),
measures each check's largest error against the single-process run, and rewrites the
part of docs/parity_matrix.md between the two `matrix` markers: one line per row, then the
pairs of levels no valid layout has, each with the reason `Config.validate` gives.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_matrix as T  # noqa: E402
from helpers import config, initial_params  # noqa: E402
from matrix import (  # noqa: E402
    ALL_ROWS,
    ASYNC_TP_ROWS,
    FACTORS,
    LONG_CONTEXT_ROWS,
    MLA_ROWS,
    OVERLAP_FB_ROWS,
    RECIPE_ROWS,
    ROWS,
    STEPS,
    coverable_pairs,
    parse,
    validity,
)

from plait.plan.runtime_memory import not_covered  # noqa: E402
from plait.testing import merge_ranks, parity_errors  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "parity_matrix.md"
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


def errors(row: str) -> dict[str, float]:
    """The row's largest error on each check `assert_parity` makes (plait.testing's
    `parity_errors`: every rank's loss and grad norm, first gradients, parameters, and
    with MoE the balance loss and biases), keyed by tolerance name."""
    init = initial_params(*parse(row)["model"], f"train.steps={STEPS}")
    got = parity_errors(merge_ranks(T.row_run(row)), T.row_reference(row), T.precision_of(row),
                        init)
    return {k: v for k, (v, _) in got.items()}


def memory_cell(row: str) -> str:
    why = not_covered(config(*T.memory_sets(row)))
    if why is not None:  # its first clause: what it does not follow
        return "refused: " + why.split(";")[0]
    return "within 5 %"


def table(rows: tuple[str, ...] = ALL_ROWS) -> list[str]:
    lines = ["| # | layout | world | tolerance | loss | grad norm | first grads | params | "
             "MoE balance loss | MoE bias | memory vs eager model |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows, 1):
        e = errors(row)
        prec = T.precision_of(row)
        world = config(*T.row_sets(row)).parallel.world_size
        grad = f"{e['grad_rtol']:.1e}" if "grad_rtol" in e else f"{e['grad_l2_rtol']:.1e} (L2)"
        param = (f"{e['param_lr_rtol']:.1e} (x lr)" if "param_lr_rtol" in e
                 else f"{e['param_move_rtol']:.1e} (movement)")
        aux = f"{e['aux_rtol']:.1e}" if "aux_rtol" in e else "-"
        bias = f"{e['bias_atol']:.1e}" if "bias_atol" in e else "-"
        lines.append(f"| {i} | `{row}` | {world} | {prec} | {e['loss_rtol']:.1e} | "
                     f"{e['norm_rtol']:.1e} | {grad} | {param} | {aux} | {bias} | "
                     f"{memory_cell(row)} |")
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
    n, m, lc, a = len(ROWS), len(MLA_ROWS), len(LONG_CONTEXT_ROWS), len(ASYNC_TP_ROWS)
    body = ["", f"{len(ALL_ROWS)} layouts (rows {n + 1}-{n + m} with multi-head latent "
            f"attention, the next {lc} with context parallel's all-to-all modes, the next "
            f"{a} with async tensor parallel, the next {len(RECIPE_ROWS)} with packed "
            "documents, float8 GEMMs and compilation, the last "
            f"{len(OVERLAP_FB_ROWS)} with DualPipe's F&B pairs overlapped), "
            f"{STEPS} steps each, in float64 but the bf16 rows (the fp8 rows: float8 GEMMs "
            "in float64), the worst error over every rank (python tests/parity_table.py).",
            "",
            *table(), "", "Pairs of levels that no valid layout at world <= 8 has:", "",
            *refused_pairs(), ""]
    DOC.write_text(head + BEGIN + "\n".join(body) + END + tail)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
