"""Measured model-state memory per ZeRO stage vs the formula, bytes per parameter.

    python benchmarks/zero_memory.py

The same layouts as tests/test_zero.py's memory test (dp=4, bf16); prints the table in
docs/zero.md.
"""

import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

from test_zero import _memory  # noqa: E402

torch.set_num_threads(1)
print(f"{'stage':>5}{'params':>8}{'grads':>8}{'optim':>8}{'comm':>8}{'formula':>9}{'peak':>8}")
for stage in (0, 1, 2, 3):
    row, phi = _memory(stage)
    pre = row["pre_optimizer"]
    formula = {0: 16, 1: 4 + 12 / 4, 2: 2 + 14 / 4, 3: 16 / 4}[stage]
    print(f"{stage:>5}" + "".join(f"{pre[c] / phi:>8.2f}" for c in
                                   ("params", "grads", "optimizer", "comm"))
          + f"{formula:>9.2f}{row['peak_total'] / phi:>8.2f}")
print(f"(bytes per parameter; {phi:,} parameters)")
