"""Shared pieces of the benchmarks: a config, a token file, a torch-native training loop.

The torch-native peers train the same model from the same weights on the same global
batches with torch's AdamW, so step times and losses are comparable with plait's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.config import Config, load_config  # noqa: E402
from plait.device.memory import MemoryTracker  # noqa: E402
from plait.model.loss import microbatch_loss  # noqa: E402
from plait.optim import decays  # noqa: E402
from plait.throughput import mean_step_time  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile  # noqa: E402
from plait.train.lr_schedule import lr_at  # noqa: E402

WARMUP = 2  # steps left out of the mean step time


def bench_config(model: str, world: int, steps: int, seq_len: int, vocab: int,
                 *sets: str) -> Config:
    return load_config(overrides={"model_name": model}, sets=[
        f"parallel.dp={world}", f"train.steps={steps}", f"train.global_batch={4 * world}",
        f"train.seq_len={seq_len}", f"model.vocab_size={vocab}", *sets]).check(world)


def batches(cfg: Config, path: Path) -> GlobalBatches:
    t = cfg.train
    return GlobalBatches(TokenFile.open(path), t.seq_len, t.global_batch, t.seed,
                         cfg.model.vocab_size)


def wrap_peer(model: torch.nn.Module, peer: str, bucket_mb: float) -> torch.nn.Module:
    """The torch-native peer around `model`: FSDP2 (`fully_shard` per block, then the
    whole) or DDP with plait's bucket size."""
    if peer == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, bucket_cap_mb=bucket_mb)


def torch_adamw(named: list, cfg: Config) -> torch.optim.AdamW:
    t = cfg.train
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if decays(n, p)], "weight_decay": t.weight_decay},
         {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def torch_loop(wrapped: torch.nn.Module, params: list, optim, cfg: Config, data: GlobalBatches,
               rank: int, world: int, steps: int, memory_step: int = -1,
               sources: Callable[[], dict] | None = None) -> dict:
    """A torch-native data-parallel step: the peer averages gradients, so the loss is
    scaled by world to give the same gradient as plait's sum of (local sum / global tokens)."""
    t = cfg.train
    times, losses, peak = [], [], None
    per = t.global_batch // world
    for step in range(steps):
        tracker = MemoryTracker(sources) if step == memory_step else None
        if tracker is not None:
            tracker.__enter__()
        start = time.perf_counter()
        tokens = data.local_batch(step, rank, world)
        loss = microbatch_loss(wrapped, tokens, per * t.seq_len * world) * world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for g in optim.param_groups:
            g["lr"] = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        optim.step()
        optim.zero_grad(set_to_none=True)
        total = loss.detach() / world
        dist.all_reduce(total)
        times.append(time.perf_counter() - start)
        losses.append(float(total))
        if tracker is not None:
            tracker.__exit__(None, None, None)
            peak = tracker.peak_total
    return {"times": times, "losses": losses, "peak": peak}


def median_ms(runs: list[dict]) -> float:
    """The median over runs of each run's mean step time, the first WARMUP steps of each
    left out (plait/throughput.py): one slow run on a shared machine moves it less than a
    mean over runs would."""
    return statistics.median(mean_step_time(r["times"], warmup=WARMUP) for r in runs) * 1e3


def max_loss_gap(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


# --- goals: each benchmark prints its goal beside its ratio -----------------------------------


def met(value: float, goal: float) -> str:
    """'met' when value <= goal (every goal here is an upper bound), else 'not met'."""
    return "met" if value <= goal else "not met"


def performance_rows(rows: list[tuple[str, str, str, str]]) -> str:
    """The goals' rows for (what, measured, goal, met?), each with the exact command (this
    process's), the date and the load average now (`--write` puts the same rows in the
    benchmark's docs/results/ file: benchmarks/results.py)."""
    command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    return "\n".join(["goals:"] + [
        f"| {what} | `{command}` | {measured} | {goal} | {ok} | {when} | {load:.1f} |"
        for what, measured, goal, ok in rows])

