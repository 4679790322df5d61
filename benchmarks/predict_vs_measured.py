"""Predicted (planner, kernels="eager") vs measured peak memory per rank, by category.

    python benchmarks/predict_vs_measured.py

The layouts of tests/test_predict_vs_measured.py; prints the table in docs/planner.md
(KiB, predicted/measured, at the peak).
"""

import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

from helpers import config, run_layout, token_file  # noqa: E402
from test_predict_vs_measured import CATS, LAYOUTS, MEASURE  # noqa: E402

from plait.plan.runtime_memory import eager_memory_by_rank  # noqa: E402
from plait.train.data import TokenFile  # noqa: E402

torch.set_num_threads(1)
print("| layout | rank | peak moment | total | " + " | ".join(CATS) + " |")
print("|---|---|---|---|" + "---|" * len(CATS))
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
        print(f"| {name} | {rank} | {pred['moment']} | {pred['total'] / 1024:.1f}/"
              f"{mem['peak_total'] / 1024:.1f} | " + " | ".join(cells) + " |")
