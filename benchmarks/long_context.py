"""How long a sequence fits, and which context-parallel mode the planner picks for it:
Llama 3 8B on H100s (`plait plan`'s search and formulas; no GPU runs here).

    python benchmarks/long_context.py [--gpus 8 64] [--write docs/results/long_context.md]

1. For each GPU count: the longest sequence (powers of two from 32K to 2M tokens) for
   which the planner's search finds a layout that fits in memory (a global batch of 4M
   tokens, at least one sequence a replica).
2. At 128K and 1M tokens: the search's best layout, then every cp mode priced on it
   (`plait.plan.sequence_modes.price_modes`: step time, exposed exchange, memory of the
   most loaded rank, bytes a rank sends per step over NVLink and across nodes) and the
   mode it chooses (the fastest that fits).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results  # noqa: E402

from plait.plan.basis import Training  # noqa: E402
from plait.plan.calibration import EFFICIENCY  # noqa: E402
from plait.plan.hardware import GPUS, Cluster  # noqa: E402
from plait.plan.search import PlanError, search  # noqa: E402
from plait.plan.sequence_modes import choose, price_modes  # noqa: E402
from plait.plan.shape import from_preset  # noqa: E402

MODEL, GPU, BATCH_TOKENS = "llama3-8b", "h100-sxm", 4 * 2**20
LENGTHS = [2**k for k in range(15, 22)]  # 32K .. 2M


def best(gpus: int, seq: int):
    """The search's best layout for Llama 3 8B at `seq` tokens on `gpus` H100s, or None."""
    shape = from_preset(MODEL, seq)
    cluster = Cluster(GPUS[GPU], gpus)
    train = Training(max(BATCH_TOKENS // seq, 1))
    try:
        res = search(shape, cluster, train, EFFICIENCY, top=1)
    except PlanError:
        return None
    return (shape, cluster, train, res.top[0]) if res.top else None


def longest(gpus: int) -> int | None:
    fits = [s for s in LENGTHS if best(gpus, s) is not None]
    return max(fits) if fits else None


def mode_rows(gpus: int, seq: int) -> list[str]:
    found = best(gpus, seq)
    if found is None:
        return [f"| {gpus} | {seq // 1024}K | no layout fits | | | | | | |"]
    shape, cluster, train, est = found
    prices = price_modes(shape, cluster, train, est.layout, EFFICIENCY)
    pick = choose(prices)
    rows = []
    for p in prices:
        lay = est.layout.label() + (f", a2a group {p.degree}" if p.mode == "hierarchical" else "")
        if p.problem:
            rows.append(f"| {gpus} | {seq // 1024}K | {lay} | {p.mode} | refused: {p.problem} "
                        "| | | | |")
            continue
        mark = " (chosen)" if pick is not None and p.mode == pick.mode else ""
        rows.append(f"| {gpus} | {seq // 1024}K | {lay} | {p.mode}{mark} | {p.step_time:.2f} | "
                    f"{p.exposed:.2f} | {p.memory / 1e9:.1f} | {p.bytes_intra / 1e9:.1f} | "
                    f"{p.bytes_inter / 1e9:.1f} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    results.add_write_flag(ap)
    args = ap.parse_args()
    lines = ["# Long context: the longest sequence that fits, and the cp mode chosen", "",
             f"Regenerate: `{results.command()}`", "", f"Run: {results.run_line()}", "",
             f"Planner only: {MODEL} on {GPU}, bf16, Adam, a global batch of 4M tokens "
             "(at least one sequence); no GPU run.", "",
             "| GPUs | longest sequence that fits (of 32K .. 2M) |", "|---|---|"]
    for g in args.gpus:
        n = longest(g)
        lines.append(f"| {g} | {'none' if n is None else f'{n // 1024}K'} |")
    lines += ["", "Each mode priced on the search's best layout (step s, exposed cp exchange "
              "s a step, GB on the most loaded rank, GB a rank sends a step over NVLink / "
              "across nodes):", "",
              "| GPUs | sequence | layout | cp mode | step s | exposed s | memory GB | "
              "NVLink GB | inter-node GB |", "|---|---|---|---|---|---|---|---|---|"]
    for g in args.gpus:
        for seq in (131072, 1048576):
            lines += mode_rows(g, seq)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        Path(args.write).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
