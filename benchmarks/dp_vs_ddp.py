"""Bucketed data parallel (plait) vs torch DDP: same model, data, world size, one run.

    python benchmarks/dp_vs_ddp.py [--world 4] [--steps 12] [--model small]

Both train the same model from the same weights on the same global batches with AdamW and
grad clipping; gloo on CPU, one thread per rank. Prints mean step time (first 2 steps
skipped as warm-up), the ratio plait/DDP (goal <= 1.0), the losses' agreement, and gradient
bytes per step: plait's from its ledger, DDP's from a comm hook that sizes each bucket in a
separate counting pass (the hook is not present in the timed run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.config import load_config  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.model.transformer import build_model  # noqa: E402
from plait.testing import run_ranks  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file  # noqa: E402
from plait.train.loop import train  # noqa: E402
from plait.train.optim import decays, lr_at  # noqa: E402
from plait.train.step import microbatch_loss  # noqa: E402

WARMUP = 2


def _cfg(args, world):
    return load_config(overrides={"model_name": args.model}, sets=[
        f"parallel.dp={world}", f"train.steps={args.steps}", f"train.global_batch={4 * world}",
        f"train.seq_len={args.seq_len}", "parallel.data_parallel=bucketed",
        f"model.vocab_size={args.vocab}"]).check(world)


def _plait(rank, world, args, path):
    cfg = _cfg(args, world)
    mesh = ParallelMesh.build(cfg.parallel)
    batches = GlobalBatches(TokenFile.open(path), cfg.train.seq_len, cfg.train.global_batch,
                            cfg.train.seed, cfg.model.vocab_size)
    res = train(cfg, mesh, batches)
    grads = [r for r in mesh.ledger.records if r.tag == "grads" and r.step == 1]
    return {"times": [m["step_time"] for m in res.metrics], "losses": res.losses,
            "bytes": sum(r.sent for r in grads), "calls": len(grads)}


def _ddp(rank, world, args, path, count_bytes=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = _cfg(args, world)
    t = cfg.train
    batches = GlobalBatches(TokenFile.open(path), t.seq_len, t.global_batch, t.seed,
                            cfg.model.vocab_size)
    model = build_model(cfg.model, seed=t.seed)
    named = list(model.named_parameters())
    ddp = DDP(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    sent = []
    if count_bytes:
        def hook(state, bucket):
            b = bucket.buffer()
            sent.append(2 * (world - 1) / world * b.numel() * b.element_size())
            return dist.all_reduce(b, async_op=True).get_future().then(lambda f: f.value()[0])
        ddp.register_comm_hook(None, hook)
    optim = torch.optim.AdamW(
        [{"params": [p for n, p in named if decays(n, p)], "weight_decay": t.weight_decay},
         {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    times, losses = [], []
    per = t.global_batch // world
    for step in range(1 if count_bytes else t.steps):
        start = time.perf_counter()
        tokens = batches.local_batch(step, rank, world)
        # DDP averages gradients over ranks; scale the loss by world so that the average of
        # (local sum x world / global tokens) is the global mean, as in plait
        loss = microbatch_loss(ddp, tokens, per * t.seq_len * world) * world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for g in optim.param_groups:
            g["lr"] = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        optim.step()
        optim.zero_grad(set_to_none=True)
        total = loss.detach() / world
        dist.all_reduce(total)
        times.append(time.perf_counter() - start)
        losses.append(float(total))
    return {"times": times, "losses": losses, "bytes": sum(sent), "calls": len(sent)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_token_file(Path(tmp) / "bench.bin", 400_000, args.vocab)
        ddp_bytes = run_ranks(_ddp, args.world, args, path, count_bytes=True, timeout=600)[0]
        # alternate the two so that machine noise hits both alike
        plait_runs, ddp_runs = [], []
        for _ in range(2):
            plait_runs.append(run_ranks(_plait, args.world, args, path, timeout=600)[0])
            ddp_runs.append(run_ranks(_ddp, args.world, args, path, timeout=600)[0])
    p_times = [x for r in plait_runs for x in r["times"][WARMUP:]]
    d_times = [x for r in ddp_runs for x in r["times"][WARMUP:]]
    p_ms, d_ms = statistics.mean(p_times) * 1e3, statistics.mean(d_times) * 1e3
    loss_gap = max(abs(a - b) for a, b in zip(plait_runs[0]["losses"], ddp_runs[0]["losses"]))
    print(f"model {args.model}, world {args.world} (gloo, CPU), {args.steps} steps x 2 runs")
    print(f"{'':8}{'step ms':>10}{'grad bytes/step/rank':>24}{'calls':>7}")
    print(f"{'plait':8}{p_ms:>10.1f}{plait_runs[0]['bytes']:>24,.0f}{plait_runs[0]['calls']:>7}")
    print(f"{'DDP':8}{d_ms:>10.1f}{ddp_bytes['bytes']:>24,.0f}{ddp_bytes['calls']:>7}")
    print(f"ratio plait/DDP step time: {p_ms / d_ms:.3f}  (goal <= 1.0)")
    print(f"max |loss difference| over steps: {loss_gap:.2e}")


if __name__ == "__main__":
    main()
