"""Run a function on N gloo ranks in forked processes: for tests, benchmarks and `plait
calibrate` (which measures on forked ranks).

Fork (not spawn) because every spawned child re-imports torch (~1 s a rank); a forked child
must call `torch.set_num_threads(1)` before its first op or it can hang when the parent has
already run a parallel op (docs/architecture.md,
"Facts about torch 2.13 on CPU/gloo, measured"). A failing rank's traceback is raised in the
caller; a rank that neither finishes nor fails within `timeout` is killed and reported:
never a hang.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.device.network import bound_store, loopback_interface, transport_env

LOOPBACK = loopback_interface()


class RankFailure(AssertionError):
    """One or more ranks raised or timed out; the message holds their tracebacks."""


def free_port() -> int:
    """A port that was free a moment ago (for launchers that must be told one; it can be
    taken before they bind it: `run_ranks` binds its own store instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous(rank: int, world_size: int, port, port_ready, timeout: datetime.timedelta
                ) -> dist.TCPStore:
    """Rank 0 binds the store on a port the OS picks and publishes it; the others connect.
    No window in which another process can take the port (free_port's race), and no store
    thread in the parent (forking a process with a live thread can deadlock the child)."""
    if rank == 0:
        # listening on loopback only, not every interface (plait/device/network.py)
        store = bound_store("127.0.0.1", 0, world_size, timeout)
        port.value = store.port
        port_ready.set()
        return store
    if not port_ready.wait(timeout.total_seconds()):
        raise TimeoutError(f"rank 0 did not publish its store port within {timeout}")
    return dist.TCPStore("127.0.0.1", port.value, world_size, is_master=False, timeout=timeout)


def _child(fn: Callable, rank: int, world_size: int, port, port_ready, pg_timeout: float,
           results: mp.Queue, args: tuple, kwargs: dict, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank, bound before NCCL sees the group
            torch.cuda.set_device(rank)
        # gloo takes its interface from the environment only: the loopback one, so that no
        # rank listens on the network (read by init_process_group below, in this child)
        os.environ.update(transport_env(LOOPBACK))
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = _rendezvous(rank, world_size, port, port_ready, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            results.close()
            results.join_thread()  # flush the result into the pipe before the hard exit
        finally:
            os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              pg_timeout: float = 60.0, backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` ranks; return results by rank.

    `backend="nccl"` (benchmarks/gpu_check.py): rank r on cuda:r, the children spawned, not
    forked (CUDA cannot be used in a child forked from a process that initialised it), so
    `fn` must be importable by the child.

    `fn` must be importable or defined before the call (the children are forked). Rank 0
    binds the rendezvous store (`_rendezvous`). `pg_timeout` (a collective that waits
    longer fails) allows for 8 ranks time-sliced on 2 busy cores; `timeout` bounds the
    whole run.
    """
    ctx = mp.get_context("spawn" if backend == "nccl" else "fork")
    results: mp.Queue = ctx.Queue()
    port, port_ready = ctx.Value("i", 0), ctx.Event()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, r, world_size, port, port_ready, pg_timeout, results, args,
                               kwargs, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    first_seen_dead: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                # a rank that died without reporting (segfault, os._exit) fails the job; its
                # result, if any, was flushed before exit, so allow it a moment to arrive
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if p.is_alive() or r in outputs or r in errors:
                        continue
                    first_seen_dead.setdefault(r, now)
                    if now - first_seen_dead[r] > 2.0:
                        errors[r] = f"rank {r} exited (code {p.exitcode}) without a result"
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                # one failure poisons the group: give the others a moment, then stop
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join()
    missing = [r for r in range(world_size) if r not in outputs and r not in errors]
    if errors or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")
        raise RankFailure(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(parts))
    return [outputs[r] for r in range(world_size)]
