"""Run a function on N gloo ranks in forked processes: for tests and benchmarks.

Fork (not spawn) because every spawned child re-imports torch (~1 s a rank); a forked child
must call `torch.set_num_threads(1)` before its first op or it can hang when the parent has
already run a parallel op (DESIGN.md, Facts). A failing rank's traceback is raised in the
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


class RankFailure(AssertionError):
    """One or more ranks raised or timed out; the message holds their tracebacks."""


def free_port() -> int:
    """A port that was free a moment ago (for launchers that must be told one; it can be
    taken before they bind it: `run_ranks` binds its own store instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, pg_timeout: float,
           results: mp.Queue, args: tuple, kwargs: dict) -> None:
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
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
              pg_timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` ranks; return results by rank.

    `fn` must be importable or defined before the call (the children are forked). The
    rendezvous store is bound here, on a port the OS picks, before any rank starts: no
    window in which another process can take the port. `pg_timeout` (a collective that
    waits longer fails) allows for 8 ranks time-sliced on 2 busy cores; `timeout` bounds
    the whole run.
    """
    ctx = mp.get_context("fork")
    results: mp.Queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout))
    port = store.port
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, r, world_size, port, pg_timeout, results, args, kwargs))
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
        del store  # the ranks are gone: close the rendezvous
    missing = [r for r in range(world_size) if r not in outputs and r not in errors]
    if errors or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")
        raise RankFailure(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(parts))
    return [outputs[r] for r in range(world_size)]


# ---- the parity oracle's tolerances: the one place they live (docs/parity.md says why) ----

PARITY_TOLERANCES = {
    # fp32: the layout changes only the order of floating-point sums (dp all-reduce, micro-
    # batch accumulation). Measured worst cases over 5 steps: loss 8e-8 relative, params
    # 2e-6 absolute. Adam divides by sqrt(v), so a rounding difference in a tiny gradient can
    # move a weight by up to ~lr per step; 1e-4 leaves margin over the measured 2e-6.
    "fp32": {"loss_rtol": 1e-5, "param_atol": 1e-4},
    # bf16 compute (fp32 masters): activations and gradients carry 8 mantissa bits, so the
    # reduction order shows at ~2^-8 relative in the loss.
    "bf16": {"loss_rtol": 2e-2, "param_atol": 2e-2},
    # fp32 tensor parallel: TP also reorders sums *inside* every layer (row-parallel partial
    # products, the vocab-parallel softmax), so a gradient element whose terms cancel can
    # carry a larger relative error; Adam's g/sqrt(v) turns that into up to ~lr per step.
    # Measured over 4 steps: loss 3e-7 relative; params 4e-6 (MHA) and 2.9e-4 (GQA, one
    # embedding element of a token seen once). The gradients themselves are checked tightly:
    # first-step gradients within grad_rtol of each tensor's largest element (measured 6e-7).
    "fp32-tp": {"loss_rtol": 1e-5, "param_atol": 1e-3, "grad_rtol": 1e-5},
}


def assert_parity(losses: list[float], params: dict, ref_losses: list[float], ref_params: dict,
                  precision: str = "fp32") -> None:
    """Loss at every step and every final parameter within the stated tolerances."""
    tol = PARITY_TOLERANCES[precision]
    assert len(losses) == len(ref_losses), (len(losses), len(ref_losses))
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= tol["loss_rtol"] * abs(b), (
            f"step {step}: loss {a!r} vs reference {b!r} (rtol {tol['loss_rtol']})")
    assert set(params) == set(ref_params), set(params) ^ set(ref_params)
    for name, ref in ref_params.items():
        diff = float((params[name].float() - ref.float()).abs().max())
        assert diff <= tol["param_atol"], (
            f"{name}: max |diff| {diff:.3e} > {tol['param_atol']} after {len(losses)} steps")
