"""The longest sequence that trains within a memory budget per rank, per context-parallel
mode, measured on 4 CPU ranks beside the planner's answer for the same configurations.

    python benchmarks/long_context_fit.py [--seq-lens 1024 4096 16384]
        [--budget-mb 16] [--write docs/results/long_context_fit.md]

For each mode (ring, allgather, a2a, hierarchical with all-to-all pairs) and sequence
length: the tiny model (4 heads, 2 KV heads), cp = 4, one sequence a step, 2 steps; the
measured peak of live bytes on the busiest rank during step 1 (`train.memory_step`, the
device's memory meter) and the planner's memory of the most loaded rank
(`plait.plan.estimate_config`, its flash-attention activation model). The longest length
within the budget is reported for each. gloo on CPU, one thread per rank.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results  # noqa: E402

from plait.config import load_config  # noqa: E402
from plait.launch.forked import run_ranks  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.plan import estimate_config  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file  # noqa: E402
from plait.train.loop import train  # noqa: E402

MODES = (("ring", 0), ("allgather", 0), ("a2a", 0), ("hierarchical", 2))


def _cfg(mode: str, degree: int, seq: int):
    return load_config(sets=[
        "parallel.cp=4", f"parallel.cp_mode={mode}", f"parallel.cp_a2a={degree}",
        "train.steps=2", "train.global_batch=1", f"train.seq_len={seq}",
        f"model.max_seq_len={seq}", "model.vocab_size=256", "train.memory_step=1",
        "model.n_kv_heads=2"]).check(4)


def _train(rank, world, mode, degree, seq, path):
    cfg = _cfg(mode, degree, seq)
    mesh = ParallelMesh.build(cfg.parallel)
    t = cfg.train
    res = train(cfg, mesh, GlobalBatches(TokenFile.open(path), t.seq_len, t.global_batch,
                                         t.seed, cfg.model.vocab_size))
    return res.metrics[1]["memory"]["peak_total"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--budget-mb", type=float, default=16.0)
    results.add_write_flag(ap)
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "fit.bin"
    synthetic_token_file(path, 8 * max(args.seq_lens) + 1, 256, seed=5)
    budget = args.budget_mb * 2**20
    lines = ["| mode | " + " | ".join(f"{s} measured / planned MB" for s in args.seq_lens)
             + f" | longest within {args.budget_mb:g} MB: measured | planned |",
             "|---|" + "---|" * (len(args.seq_lens) + 2)]
    for mode, degree in MODES:
        cells, fit_m, fit_p = [], None, None
        for seq in args.seq_lens:
            measured = max(run_ranks(_train, 4, mode, degree, seq, path, timeout=1200))
            planned = float(estimate_config(_cfg(mode, degree, seq)).memory_total)
            cells.append(f"{measured / 2**20:.1f} / {planned / 2**20:.1f}")
            fit_m = seq if measured <= budget else fit_m
            fit_p = seq if planned <= budget else fit_p
            print(mode, seq, cells[-1], flush=True)
        name = mode + (" (pairs)" if degree else "")
        none = f"< {args.seq_lens[0]}"
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {fit_m or none} | {fit_p or none} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        Path(args.write).write_text(
            "# Long context on 4 CPU ranks: the longest sequence within a memory budget\n\n"
            f"Regenerate: `{results.command()}`\n\nRun: {results.run_line()}\n\n"
            "The tiny model (2 KV heads), cp = 4, one sequence a step: peak live bytes on the "
            "busiest rank during step 1, beside the planner's memory of the most loaded rank "
            "(its flash-attention activation model).\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
