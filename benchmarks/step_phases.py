"""Where one rank's step CPU goes, plait against torch, in one process (no communication):
forward + backward, AdamW (plait's foreach update against torch.optim.AdamW), the grad
norm (plait's against torch's clip_grad_norm_), and bucketed DP's packing of the
gradients (concatenate, copy back). Thread CPU time, median of `--repeats`, one thread.

    python benchmarks/step_phases.py [--model small] [--batch 4] [--seq-len 128]

A benchmark, not a test: it explains the dp_vs_ddp.py ratio (docs/performance.md).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from plait.config import load_config
from plait.model.loss import microbatch_loss
from plait.model.transformer import build_model
from plait.optim import MixedPrecisionAdamW


def thread_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(overrides={"model_name": args.model},
                      sets=[f"model.vocab_size={args.vocab}"])
    model = build_model(cfg.model, seed=0)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1))

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        microbatch_loss(model, tokens, args.batch * args.seq_len).backward()

    def plait_norm() -> float:
        return math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in params))

    def pack() -> None:  # bucketed DP: one flat bucket, then the reduced values back
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    r = args.repeats
    rows = [("forward + backward", thread_ms(forward_backward, r), None)]
    ours = MixedPrecisionAdamW(named, (0.9, 0.95), 1e-8, 0.1)
    theirs = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rows.append(("AdamW", thread_ms(lambda: ours.step(1e-4, 0.5), r),
                 thread_ms(theirs.step, r)))
    rows.append(("grad norm / clip", thread_ms(plait_norm, r),
                 thread_ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), r)))
    rows.append(("DP bucket pack + unpack", thread_ms(pack, r), None))
    print(f"model {args.model} ({sum(p.numel() for p in params):,} parameters), batch "
          f"{args.batch} x seq {args.seq_len}, one thread, thread CPU ms, median of {r}")
    print(f"{'phase':26}{'plait':>9}{'torch':>9}")
    for name, mine, peer in rows:
        print(f"{name:26}{mine:>9.2f}{'' if peer is None else f'{peer:.2f}':>9}")


if __name__ == "__main__":
    main()
