"""Shared pieces of the benchmarks: a config, a token file, a torch-native training loop,
and plait's runs alternated with its torch peer's.

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
from plait.launch.forked import run_ranks  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.model.loss import microbatch_loss  # noqa: E402
from plait.model.transformer import build_model  # noqa: E402
from plait.optim import decays  # noqa: E402
from plait.throughput import mean_step_time  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile  # noqa: E402
from plait.train.loop import train  # noqa: E402
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


def wrap_peer(model: torch.nn.Module, peer: str, bucket_mb: float,
              replicate: int = 1) -> torch.nn.Module:
    """The torch-native peer around `model`: FSDP2 (`fully_shard` per block, then the
    whole), HSDP (the same on a 2-D mesh: sharded inside groups of world / `replicate`
    consecutive ranks, replicated over `replicate` of them; every module resharded after
    its forward, as ZeRO-3 frees what it gathered) or DDP with plait's bucket size."""
    if peer in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        how: dict = {}
        if peer == "hsdp":
            shape = (replicate, dist.get_world_size() // replicate)
            how = {"mesh": init_device_mesh("cpu", shape, mesh_dim_names=("replicate",
                                                                           "shard")),
                   "reshard_after_forward": True}
        for block in model.layers:
            fully_shard(block, **how)
        return fully_shard(model, **how)
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


def plait_run(rank: int, world: int, args, path: Path, sets: tuple[str, ...],
              measure: bool) -> dict:
    """plait's run of `args` (model, steps, seq_len, vocab) with `sets`: step times,
    losses, and the peak memory of step 1 when `measure`."""
    cfg = bench_config(args.model, world, args.steps, args.seq_len, args.vocab, *sets,
                       f"train.memory_step={1 if measure else -1}")
    res = train(cfg, ParallelMesh.build(cfg.parallel), batches(cfg, path))
    peak = res.metrics[1].get("memory", {}).get("peak_total")
    return {"times": [m["step_time"] for m in res.metrics], "losses": res.losses, "peak": peak}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def peer_run(rank: int, world: int, args, path: Path, peer: str, measure: bool,
             replicate: int = 1) -> dict:
    """The torch peer's run of the same (`wrap_peer`), measured alike."""
    cfg = bench_config(args.model, world, args.steps, args.seq_len, args.vocab)
    model = build_model(cfg.model, seed=cfg.train.seed)
    wrapped = wrap_peer(model, peer, cfg.parallel.bucket_mb, replicate)
    named = list(model.named_parameters())
    optim = torch_adamw(named, cfg)

    def sources():
        state = [_local(v) for s in optim.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        return {"params": [_local(p) for _, p in named],
                "grads": [_local(p.grad) for _, p in named if p.grad is not None],
                "optimizer": state}

    return torch_loop(wrapped, [p for _, p in named], optim, cfg, batches(cfg, path), rank,
                      world, args.steps, memory_step=1 if measure else -1, sources=sources)


def alternated(args, path: Path, sets: tuple[str, ...], peer: str, replicate: int = 1
               ) -> dict:
    """`args.runs` timed runs of plait (with `sets`) and of its peer on `args.world` ranks,
    alternated so that machine noise hits both alike, then one run of each measuring
    memory: the runs, the median step times (ms) and the peaks (bytes, rank 0)."""
    mine, theirs = [], []
    for _ in range(args.runs):
        mine.append(run_ranks(plait_run, args.world, args, path, sets, False, timeout=900)[0])
        theirs.append(run_ranks(peer_run, args.world, args, path, peer, False, replicate,
                                timeout=900)[0])
    plait_peak = run_ranks(plait_run, args.world, args, path, sets, True, timeout=900)[0]
    peer_peak = run_ranks(peer_run, args.world, args, path, peer, True, replicate,
                          timeout=900)[0]
    return {"mine": mine, "theirs": theirs, "plait_ms": median_ms(mine),
            "peer_ms": median_ms(theirs), "plait_peak": plait_peak["peak"],
            "peer_peak": peer_peak["peak"]}


def each_ms(runs: list[dict]) -> str:
    """Each run's mean step time (ms), the first WARMUP steps left out."""
    return " ".join(f"{mean_step_time(r['times'], warmup=WARMUP) * 1e3:.1f}" for r in runs)


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

