"""Recomputation's trade, measured: step time, peak activation bytes and the recomputed
forwards' time for none / selective / full, at pp=1 and under a whole-B (1f1b) and a
split-backward (zb-v) pipeline schedule.

    python benchmarks/recompute.py            # step time table
    python benchmarks/recompute.py --memory   # peak activations per pp rank, per schedule
    ... [--write docs/results/recompute.md]   # (or recompute_memory.md) also as markdown

The peer is torch itself: plait's recomputation is torch's non-reentrant checkpoint with
its selective-checkpoint policy (plait/model/recompute.py), so the ratios printed are
against plait without recomputation on the same layout. Expected extra forward FLOPs are
`extra_forward_flops_per_token` (docs/recompute.md); on this CPU the element-wise ops the
FLOP count leaves out are a visible part of the time. Step times are means over steps
2-5 (step 1 measures memory: the tracker slows it).
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

import results  # noqa: E402
from helpers import config, run_layout  # noqa: E402

from plait.model.recompute import Recompute, extra_forward_flops_per_token  # noqa: E402

MODEL = ["model_name=small", "model.vocab_size=256", "train.seq_len=128",
         "train.global_batch=8", "train.steps=6", "train.memory_step=1"]
LAYOUTS = {"pp=1 m=2": ["parallel.microbatches=2"],
           "pp=2 1f1b m=4": ["parallel.pp=2", "parallel.schedule=1f1b",
                             "parallel.microbatches=4"],
           "pp=2 zb-v m=4": ["parallel.pp=2", "parallel.schedule=zb-v",
                             "parallel.microbatches=4"]}


MEMORY = ["model_name=small", "model.vocab_size=256", "train.seq_len=128",
          "train.global_batch=8", "train.steps=2", "train.memory_step=1", "model.n_layers=8",
          "parallel.pp=2", "parallel.microbatches=8"]


MODES = ("none", "selective", "full")


def memory() -> list[tuple[str, ...]]:
    """Peak activation MB per pp rank for each schedule kind and mode (docs/recompute.md)."""
    print(f"{'schedule':<11}" + "".join(f"{m:>16}" for m in MODES))
    rows = []
    for schedule in ("1f1b", "zb-h1", "zb-v", "dualpipev"):
        cells = []
        for mode in MODES:
            outs = run_layout(*MEMORY, f"parallel.schedule={schedule}",
                              f"train.recompute={mode}")
            mb = [o["metrics"][1]["memory"]["peak"]["activations"] / 1e6 for o in outs]
            cells.append(" / ".join(f"{x:.2f}" for x in mb))
        print(f"{schedule:<11}" + "".join(f"{c:>16}" for c in cells))
        rows.append((schedule, *cells))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", action="store_true",
                    help="peak activations per pp rank, per schedule kind and mode")
    results.add_write_flag(ap)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    torch.set_num_threads(1)
    if args.memory:
        rows = memory()
        if args.write:
            results.write(
                args.write, "Recomputation: peak activations per pipeline rank", [
                    "The small model, 8 layers, seq 128, pp = 2, 8 micro-batches; peak "
                    "activation MB of pp rank 0 / pp rank 1:\n\n"
                    + results.table(("schedule", *MODES), rows)],
                "the tracker's peak activation bytes per pipeline rank for each recompute "
                "mode, under a whole-backward schedule (1f1b) and three that split B into I "
                "and W (between I and W a stage keeps only what W reads). Bytes, not times: "
                "they do not depend on the machine's load.",
                run=results.run_line(load0))
        return
    rows = step_times()
    if args.write:
        results.write(
            args.write, "Recomputation: step time, activations, extra FLOPs", [
                "The small model, seq 128, batch 8:\n\n" + results.table(
                    ("layout", "mode", "step ms", "× none", "peak activations MB",
                     "recomputed ms/step", "FLOPs +"), rows)],
            "none / selective / full on one layout each: the mean step time (steps 2-5) and "
            "its ratio to no recomputation, the larger pp rank's peak activations, the "
            "recomputations' time inside I (split-backward schedules only; a whole B's "
            "recomputation is not timed apart) and the extra forward FLOPs "
            "(`extra_forward_flops_per_token`). On a CPU with a small model the element-wise "
            "work the FLOPs leave out and selective's per-operator dispatch mode weigh more "
            "than the FLOPs; on a shared machine single ratios move by tens of per cent.",
            run=results.run_line(load0))


def step_times() -> list[tuple[str, ...]]:
    print(f"{'layout':<15}{'mode':<11}{'step ms':>9}{'x none':>8}{'act MB':>8}"
          f"{'recomp ms':>10}{'FLOPs +%':>9}")
    rows = []
    for name, sets in LAYOUTS.items():
        base = None
        for mode in MODES:
            args = [*MODEL, *sets, f"train.recompute={mode}"]
            cfg = config(*args)
            outs = run_layout(*args)
            ms = 1e3 * statistics.mean(r["step_time"] for o in outs[:1]
                                       for r in o["metrics"][2:])
            act = max(o["metrics"][1]["memory"]["peak"]["activations"] for o in outs) / 1e6
            pipe = outs[0]["summary"].get("pipeline", {}).get("recompute", {})
            recomp = max(pipe.get("ms_per_step", [0.0]))
            split = "zb-v" in name
            flops = extra_forward_flops_per_token(
                cfg.model, cfg.train.seq_len, Recompute.of(mode), split) / \
                cfg.model.flops_per_token(cfg.train.seq_len)
            base = base or ms
            print(f"{name:<15}{mode:<11}{ms:>9.1f}{ms / base:>8.2f}{act:>8.2f}"
                  f"{recomp:>10.1f}{100 * flops:>9.1f}")
            rows.append((name, mode, f"{ms:.1f}", f"{ms / base:.2f}", f"{act:.2f}",
                         f"{recomp:.1f}" if split else "-", f"{100 * flops:.1f} %"))
    return rows


if __name__ == "__main__":
    main()
