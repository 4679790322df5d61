"""Recomputation's trade, measured: step time, peak activation bytes and the recomputed
forwards' time for none / selective / full, at pp=1 and under a whole-B (1f1b) and a
split-backward (zb-v) pipeline schedule.

    python benchmarks/recompute.py            # step time table
    python benchmarks/recompute.py --memory   # peak activations per pp rank, per schedule

The peer is torch itself: plait's recomputation is torch's non-reentrant checkpoint with
its selective-checkpoint policy (plait/model/recompute.py), so the ratios printed are
against plait without recomputation on the same layout. Expected extra forward FLOPs are
`extra_forward_flops_per_token` (docs/recompute.md); on this CPU the element-wise ops the
FLOP count leaves out are a visible part of the time. Step times are means over steps
2-5 (step 1 measures memory: the tracker slows it).
"""

import statistics
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

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


def memory() -> None:
    """Peak activation MB per pp rank for each schedule kind and mode (docs/recompute.md)."""
    print(f"{'schedule':<11}" + "".join(f"{m:>16}" for m in ("none", "selective", "full")))
    for schedule in ("1f1b", "zb-h1", "zb-v", "dualpipev"):
        row = f"{schedule:<11}"
        for mode in ("none", "selective", "full"):
            outs = run_layout(*MEMORY, f"parallel.schedule={schedule}",
                              f"train.recompute={mode}")
            mb = [o["metrics"][1]["memory"]["peak"]["activations"] / 1e6 for o in outs]
            row += f"{' / '.join(f'{x:.2f}' for x in mb):>16}"
        print(row)


def main() -> None:
    torch.set_num_threads(1)
    if "--memory" in sys.argv:
        memory()
        return
    print(f"{'layout':<15}{'mode':<11}{'step ms':>9}{'x none':>8}{'act MB':>8}"
          f"{'recomp ms':>10}{'FLOPs +%':>9}")
    for name, sets in LAYOUTS.items():
        base = None
        for mode in ("none", "selective", "full"):
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


if __name__ == "__main__":
    main()
