"""Predicted (planner, kernels="eager") vs measured peak memory per rank, by category.

    python benchmarks/predict_vs_measured.py [--write docs/results/predict_vs_measured.md]

The layouts of tests/test_predict_vs_measured.py; prints the table (KiB,
predicted/measured, at the predicted peak moment, on each pipeline rank's first rank).
`--write PATH` also writes it as markdown (docs/results/predict_vs_measured.md).
"""

import argparse
import os
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

import results  # noqa: E402
from helpers import MEMORY_CATS as CATS  # noqa: E402
from helpers import config, run_layout, token_file  # noqa: E402
from test_predict_vs_measured import LAYOUTS, MEASURE  # noqa: E402

from plait.plan.runtime_memory import eager_memory_by_rank  # noqa: E402
from plait.train.data import TokenFile  # noqa: E402

HEADER = ("layout", "rank", "peak moment", "total", *CATS)


def rows() -> list[tuple[str, ...]]:
    out_rows = []
    for name, sets in LAYOUTS.items():
        sets = [*sets, *MEASURE]
        cfg = config(*sets)
        outs = run_layout(*sets)
        windows = (len(TokenFile.open(token_file())) - 1) // cfg.train.seq_len
        by_pp = eager_memory_by_rank(cfg, windows)
        stride = cfg.parallel.tp * cfg.parallel.cp
        ranks = sorted({(r // stride) % cfg.parallel.pp: r for r in range(len(outs))}.items())
        for pp_rank, rank in ranks:
            mem, pred = outs[rank]["metrics"][1]["memory"], by_pp[pp_rank]
            cells = [f"{sum(pred[n] for n in names) / 1024:.1f}/{mem['peak'][cat] / 1024:.1f}"
                     for cat, names in CATS.items()]
            row = (name, str(rank), pred["moment"],
                   f"{pred['total'] / 1024:.1f}/{mem['peak_total'] / 1024:.1f}", *cells)
            print("| " + " | ".join(row) + " |", flush=True)
            out_rows.append(row)
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    results.add_write_flag(ap)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    torch.set_num_threads(1)
    print("| " + " | ".join(HEADER) + " |")
    print("|---|---|---|---|" + "---|" * len(CATS))
    found = rows()
    if args.write:
        results.write(
            args.write, "Peak memory: the eager model against the tracker", [
                "The tiny model (h 64, 2 layers, V 256, s 32, global batch 8; `small` with "
                "V 256 for the 4-micro-batch pipeline); KiB predicted / measured at the "
                "predicted peak moment, on the first rank of each pipeline rank:\n\n"
                + results.table(HEADER, found)],
            "`plait.plan.predict_memory(cfg, kernels=\"eager\")`, the planner's model of "
            "plait's own CPU runtime, beside the memory tracker's exact live tensor bytes "
            "on the measured step, total and per category (docs/planner_memory.md). "
            "tests/test_predict_vs_measured.py holds every cell within 5 %. The numbers are "
            "bytes, not times: they do not depend on the machine's load.",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
