"""Dry run: one rank of a layout of any size, built and trained on this one process.

`dry_run(cfg, world_size, rank, batches)` joins torch's *fake* process group (the `fake`
backend: every collective returns at once without communicating) as rank `rank` of a
`world_size`-rank layout, builds exactly what that rank holds - its pipeline stages, its
tensor-parallel slices, its ZeRO shards, through the same `parallelize` as a real run - and
trains on real tensors up to the step it measures (`measure_step`: one step at ZeRO 0/1,
two at ZeRO-2/3 or with post-validation). The stages are allocated unwritten and only the
slices this rank keeps are filled (`parallelize(shard_init=True)`), so the host never
holds or initialises a whole stage. What it measures is what the real rank would hold and
issue: memory by category (the same tracker, on the measuring step) and the ledger's
collectives with their bytes (the ledger records calls, not transfers). Beside them: the
planner's prediction for the same layout and rank (`kernels="eager"` memory, plait's own
runtime, where that model covers the layout; the rank's own collectives per step,
`rank_collectives`, from the runtime's partition).

The values computed are meaningless - received tensors are whatever the buffers held, and
a slice is filled from its own name's stream, not cut from the reference's full tensor -
so losses are not reported. The process group is the process's own: a dry run runs in a
process of its own (the CLI's `plait train --dry-run`, or a test's child).

On a collective's temporaries: with the fake backend `reduce_scatter` takes torch's own
path, not gloo's direct algorithm (plait/comm/ops.py), so the gloo-only chunk buffer of
a real CPU run is absent - as on NCCL, which the dry run of a GPU layout stands for.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import queue
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.config import Config
from plait.device import CPU, Device
from plait.ledger import data_bytes_by_dim
from plait.mesh import ParallelMesh
from plait.train.data import GlobalBatches
from plait.train.loop import TrainOptions, train


def measure_step(cfg: Config) -> int:
    """The step a dry run measures, and runs last: the first that holds what every later
    step holds. Step 0 where nothing that outlives a step is allocated during one - ZeRO 0
    and 1 with the barrier update: parameters, moments and buckets exist before step 0 and
    gradients are dropped after every step, so step 0's live tensors are step 1's (tests/
    test_dry_run.py checks a dry run's step 0 against a real run's step 1, to the byte).
    Step 1 otherwise: ZeRO-2/3 allocate their gradient shards during the first step and
    keep them, and post-validation's snapshot and speculative prefix begin in step 1 - a
    step 0 measured there misses them (measured on dp=2 tiny runs: ZeRO-2's step 0 peak
    has no gradients, step 1's has them). Every step repeats the whole schedule, so a step
    costs the same: one step instead of two halves a large layout's run."""
    lazy = cfg.parallel.zero >= 2 or cfg.parallel.optimizer_sync != "barrier"
    return 1 if lazy else 0


def dry_run(cfg: Config, world_size: int, rank: int, batches: GlobalBatches,
            device: Device = CPU) -> dict[str, Any]:
    """Rank `rank` of `cfg`'s layout on `world_size` ranks: measured memory by category,
    the ledger's bytes per mesh dim per step, and the planner's prediction for both."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait.plan.runtime_memory import predicted_rank_memory

    if cfg.parallel.world_size != world_size:
        raise ValueError(f"the layout needs {cfg.parallel.world_size} ranks (its world size), "
                         f"not --world-size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank}: choose 0..{world_size - 1}")
    cfg = copy.deepcopy(cfg)
    step = measure_step(cfg)
    cfg.train.steps = step + 1  # the measured step is the last: later ones repeat it
    cfg.train.memory_step = step
    device.activate()  # on CUDA: this rank's GPU before the group and the mesh
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = ParallelMesh.build(cfg.parallel, device=device)
        # only this rank's slices; every step whole, whatever the fake values' norm
        result = train(cfg, mesh, batches,
                       TrainOptions(shard_init=True, update_whatever_the_norm=True))
    finally:
        dist.destroy_process_group()
    measured = result.metrics[step]["memory"]
    return {"rank": rank, "world_size": world_size, "coords": dict(mesh.coords),
            "layout": mesh.describe(), "memory": measured,
            # the loader's windows: the file it reads is given beside cfg, not in it
            "predicted_memory": predicted_rank_memory(cfg, mesh.coord("pp"),
                                                      batches.n_windows),
            "bytes_per_step": payload_by_dim(mesh, step), "measured_step": step,
            "data_bytes_per_step": data_bytes_by_dim(mesh.ledger.to_dicts(step)),
            "predicted_bytes_per_step": _predicted_bytes(cfg, mesh),
            "param_count_local": sum(p.numel() for p in result.model.parameters())}


def dry_run_ranks(cfg: Config, world_size: int, ranks: list[int], token_path: Path,
                  device: Device = CPU, timeout_s: float | None = None,
                  threads: int = 1) -> list[dict[str, Any]]:
    """`dry_run` of each of `ranks`, one after the other, each in a process of its own: the
    fake process group is per process, and each rank's memory is released before the next
    starts, so the peak of the host (or GPU) stays one rank's. `threads`: the children's
    intra-op threads on CPU (what is measured does not depend on it: the tracker counts
    tensors, not a kernel's scratch). One thread: forked (a child forked from a parent
    that ran a parallel op hangs on its first unless it keeps to one thread); more, or
    CUDA: spawned (a forked child cannot use CUDA once the parent asked the driver about
    it). A child that fails raises its traceback here."""
    ctx = mp.get_context("spawn" if device.is_cuda or threads > 1 else "fork")
    results = []
    for rank in ranks:
        q = ctx.Queue()
        proc = ctx.Process(target=_dry_run_child, args=(cfg, world_size, rank,
                                                       str(token_path), device, threads, q))
        proc.start()
        try:
            results.append(_child_result(proc, q, rank, timeout_s))
        finally:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return results


def _dry_run_child(cfg: Config, world_size: int, rank: int, token_path: str, device: Device,
                   threads: int, q: Any) -> None:
    import time

    import torch

    from plait.train.data import TokenFile

    if not device.is_cuda:
        torch.set_num_threads(threads)
    try:
        t = cfg.train
        batches = GlobalBatches(TokenFile.open(token_path), t.seq_len, t.global_batch, t.seed,
                                cfg.model.vocab_size)
        start, cpu = time.perf_counter(), time.process_time()
        out = dry_run(cfg, world_size, rank, batches, device)
        # wall, and the process's CPU (every thread): on a shared machine the wall grows
        # with the load, the CPU time much less
        out["seconds"], out["cpu_seconds"] = (time.perf_counter() - start,
                                              time.process_time() - cpu)
        q.put(("ok", out))
    except BaseException:  # noqa: BLE001 - the parent raises it
        q.put(("error", traceback.format_exc()))


def _child_result(proc: Any, q: Any, rank: int, timeout_s: float | None) -> dict[str, Any]:
    import time

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            status, out = q.get(timeout=1.0)
            break
        except queue.Empty:
            if not proc.is_alive() and q.empty():  # killed (out of memory?) or crashed
                raise RuntimeError(f"the dry run of rank {rank} exited (code "
                                   f"{proc.exitcode}) without a result") from None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the dry run of rank {rank} took over {timeout_s:.0f} s"
                                   ) from None
    if status != "ok":
        raise RuntimeError(f"the dry run of rank {rank} failed:\n{out}")
    return out


RANK_NAMES = {"first": lambda world: 0, "last": lambda world: world - 1}


def parse_ranks(text: str | None, world_size: int | None) -> tuple[list[int], list[str]]:
    """`--rank`'s ranks: numbers, `first` (rank 0, the first pipeline stage) or `last`
    (rank N-1, the last stage), comma-separated; default rank 0. Problems, each naming the
    fix, instead of ranks where the text is wrong or (`world_size` known) out of range."""
    ranks, problems = [], []
    for item in (text or "0").split(","):
        item = item.strip()
        if item in RANK_NAMES:
            if world_size is not None:
                ranks.append(RANK_NAMES[item](world_size))
            continue
        try:
            rank = int(item)
        except ValueError:
            problems.append(f"--rank {item!r}: give rank numbers, first or last, "
                            "comma-separated (e.g. --rank first,last)")
            continue
        if rank < 0 or (world_size is not None and rank >= world_size):
            problems.append(f"--rank {rank}: choose a rank in 0..{(world_size or 1) - 1} "
                            f"(the layout's {world_size or 1} ranks, or --world-size)")
        ranks.append(rank)
    return list(dict.fromkeys(ranks)), problems


def payload_by_dim(mesh: ParallelMesh, step: int) -> dict[str, float]:
    """Payload bytes of every record of the step by mesh dim (receives and control
    collectives too: all a real rank's ledger holds)."""
    out: dict[str, float] = {}
    for r in mesh.ledger.for_step(step):
        out[r.dim] = out.get(r.dim, 0.0) + r.payload
    return out


def _predicted_bytes(cfg: Config, mesh: ParallelMesh) -> dict[str, float]:
    """The planner's payload bytes per step by mesh dim for this rank: its pipeline rank's
    own collectives, from the runtime's partition (plait/plan/comm/rank.py), and under
    ZeRO Muon's all-to-alls of this rank (plait/plan/muon.py: dense models)."""
    from plait.plan.comm.rank import rank_bytes_by_dim
    from plait.plan.muon import muon_payload, muon_tp_payload

    out = rank_bytes_by_dim(cfg, mesh.coord("pp"))
    m, pp = cfg.model, mesh.coord("pp")
    if cfg.train.optimizer == "muon" and not (m.n_experts or m.mla):
        dim = mesh.replica_dim() if cfg.parallel.zero else "tp"
        muon = (muon_payload(cfg, pp, mesh.coord(dim)) if cfg.parallel.zero
                else muon_tp_payload(cfg, pp, mesh.coord(dim)))
        if muon:
            out[dim] = out.get(dim, 0.0) + muon
    return out


# measured category -> the planner's categories it stands beside
TABLE_ROWS = {"params": ("parameters",), "grads": ("gradients",),
              "optimizer": ("optimizer states",), "comm": ("communication buffers",),
              "activations": ("activations", "logits")}


def dry_run_table(out: dict[str, Any]) -> str:
    """A dry run's result as text: memory per category, measured beside predicted, and
    the payload bytes per step per mesh dim, the ledger's beside the planner's."""
    from plait.train.progress import human_bytes

    def gib(x: float) -> str:
        return f"{human_bytes(x):>12}"

    pred = out["predicted_memory"]
    covered = "not_covered" not in pred
    lines = [f"dry run: rank {out['rank']} of {out['world_size']} ({out['layout']}), "
             f"coords {out['coords']}, {out['param_count_local']:,} parameters on this rank",
             f"  {'memory':<14} {'measured':>12} {'predicted':>12}"]
    for cat, names in TABLE_ROWS.items():
        p = gib(sum(float(pred[n]) for n in names)) if covered else f"{'-':>12}"
        lines.append(f"  {cat:<14} {gib(out['memory']['peak'][cat])} {p}")
    total = gib(float(pred["total"])) if covered else f"{'-':>12}"
    lines.append(f"  {'peak total':<14} {gib(out['memory']['peak_total'])} {total}")
    if not covered:
        lines.append(f"  (no memory prediction: {pred['not_covered']})")
    # the data collectives' payloads (a send counted at its sender; the few control bytes
    # - metrics, grad norm, MoE counts - left out, as the planner does)
    lines.append(f"  {'bytes/step':<14} {'ledger':>16} {'planner':>16}")
    data, planned = out["data_bytes_per_step"], out["predicted_bytes_per_step"]
    for dim in sorted(set(data) | set(planned)):
        m, p = data.get(dim), planned.get(dim)
        lines.append(f"  {dim:<14} {'-' if m is None else f'{m:,.0f}':>16} "
                     f"{'-' if p is None else f'{p:,.0f}':>16}")
    return "\n".join(lines)
