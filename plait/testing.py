"""Run a function on N gloo ranks in forked processes: for tests and benchmarks.

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


# ---- the parity oracle's tolerances: the one place they live ----------------------------
# Each bound is at most 3x the worst error measured over every comparison of its class in
# the suite (`python tests/measure_tolerances.py` re-measures them and rewrites the table in
# docs/parity.md, which states each bound's worst error and where it was seen;
# tests/test_parity_tolerances.py holds these numbers to that table). What each class
# covers, and why its errors are what they are, is docs/parity.md's "Tolerances".
PARITY_TOLERANCES = {
    # fp32, sums reordered across replicas, micro-batches and pipeline stages only. MoE:
    # identical routing, so the balancing biases are equal exactly.
    "fp32": {"loss_rtol": 5.4e-7, "norm_rtol": 7.6e-6, "grad_rtol": 2.7e-6,
             "param_atol": 8e-5, "aux_rtol": 2e-7, "bias_atol": 0.0},
    # fp32 tensor parallel: sums reordered inside every layer too (row-parallel partial
    # products, the vocab-parallel softmax)
    "fp32-tp": {"loss_rtol": 5.8e-7, "norm_rtol": 5.4e-6, "grad_rtol": 3.8e-6,
                "param_atol": 8e-5, "aux_rtol": 1.1e-7, "bias_atol": 0.0},
    # fp32 context parallel: attention's softmax merged block by block (ring) or over a
    # permuted key order (all-gather), dK/dV summed over the cp ranks
    "fp32-cp": {"loss_rtol": 6.5e-7, "norm_rtol": 4.3e-6, "grad_rtol": 3.8e-6,
                "param_atol": 8e-5, "aux_rtol": 1.4e-7, "bias_atol": 0.0},
    # fp32 tp or cp with grouped KV heads: a KV head's gradient summed over the query heads
    # of several ranks; Adam's g/sqrt(v) turns a rounding difference in a rarely seen
    # token's embedding row into up to ~lr of movement
    "fp32-gqa": {"loss_rtol": 5.4e-7, "norm_rtol": 3.5e-6, "grad_rtol": 3.1e-6,
                 "param_atol": 2.1e-4},
    # bf16 compute, fp32 masters and moments: element-wise parameter bounds mean nothing
    # (Adam turns a sign flip of a tiny bf16 gradient into +-lr a step), so each tensor's
    # error is held against the reference's own movement from the initial weights. The
    # movement bound is 2x the worst measured, below what dropping the fp32 masters gives
    # (1.07 at dp=2 over 4 steps).
    "bf16": {"loss_rtol": 4.1e-4, "norm_rtol": 1.8e-2, "grad_rtol": 5.6e-2,
             "param_move_rtol": 0.75},
    # bf16 with MoE: a token whose top-k margin is below bf16's resolution takes another
    # expert set than in the fp32 reference, moving its whole contribution between experts:
    # the gradients are compared by each tensor's relative L2 error, not element-wise, and
    # a balancing bias may differ by a few sign steps
    "bf16-moe": {"loss_rtol": 1.6e-4, "norm_rtol": 1.5e-2, "grad_l2_rtol": 0.21,
                 "param_move_rtol": 0.8, "aux_rtol": 1.6e-3, "bias_atol": 5.9e-2},
}


def merge_ranks(outs: list[dict]) -> dict:
    """One replica's (or one job's) run as one result: the union of its ranks' parameters
    and first gradients (pipeline stages; tp ranks hold the same gathered tensors, which must
    agree exactly) and MoE balancing biases, and every rank's losses, grad norms and MoE
    auxiliary losses (`ranks`), each of which `assert_parity` compares with the reference."""
    merged = {"losses": outs[0]["losses"], "grad_norms": outs[0]["grad_norms"],
              "ranks": [{k: o[k] for k in ("losses", "grad_norms", "aux_losses") if k in o}
                        for o in outs]}
    for key in ("params", "first_grads", "biases"):
        if all(o.get(key) is None for o in outs):
            continue
        union: dict[str, torch.Tensor] = {}
        for o in outs:
            for name, t in o[key].items():
                if name in union:
                    assert torch.equal(union[name], t), f"{key} {name} differs across ranks"
                union[name] = t
        merged[key] = union
    return merged


def _worst(errors: list[tuple[float, str]]) -> tuple[float, str]:
    return max(errors, key=lambda e: e[0]) if errors else (0.0, "-")


def parity_errors(run: dict, ref: Any, precision: str = "fp32",
                  init: dict[str, torch.Tensor] | None = None) -> dict[str, tuple[float, str]]:
    """A run's largest error against the reference on every check `assert_parity` makes,
    each with where it was seen: {tolerance key: (error, where)}.

    loss_rtol, norm_rtol: relative, over every step of every rank in `run["ranks"]` (or
    the run's own `losses` and `grad_norms`); grad_rtol: each first-step gradient tensor's
    largest element difference over its own largest element; grad_l2_rtol: each tensor's
    ||g - g_ref|| / ||g_ref||; param_atol: the largest absolute parameter difference;
    param_move_rtol: ||p - p_ref|| / ||p_ref - p_init|| of the worst tensor; with MoE,
    aux_rtol: the balance loss of every step of every rank (`aux_losses`), relative, and
    bias_atol: the largest difference of a balancing bias after the last step (`biases`)."""
    tol = PARITY_TOLERANCES[precision]
    ranks = run.get("ranks") or [run]
    out: dict[str, tuple[float, str]] = {}
    for key, field in (("loss_rtol", "losses"), ("norm_rtol", "grad_norms")):
        expected = ref.losses if field == "losses" else ref.grad_norms
        errs = []
        for r, got in enumerate(ranks):
            assert len(got[field]) == len(expected), (field, r, len(got[field]), len(expected))
            errs += [(abs(a - b) / abs(b), f"rank {r} step {step}")
                     for step, (a, b) in enumerate(zip(got[field], expected, strict=True))]
        out[key] = _worst(errs)
    if any("aux_losses" in r for r in ranks):  # MoE: the balance loss of every step
        expected = [m["aux_loss"] for m in ref.moe]
        out["aux_rtol"] = _worst([(abs(a - b) / abs(b), f"rank {r} step {step}")
                                  for r, got in enumerate(ranks)
                                  for step, (a, b) in enumerate(zip(got["aux_losses"], expected,
                                                                    strict=True))])
    if run.get("biases") is not None:  # MoE: the balancing bias after the last step
        expected = ref.moe[-1]["bias"]
        assert set(run["biases"]) == set(expected), set(run["biases"]) ^ set(expected)
        out["bias_atol"] = _worst([(float((run["biases"][n] - b).abs().max()), n)
                                   for n, b in expected.items()])
    grads = run.get("first_grads")
    if grads is not None and tol.get("grad_rtol") is not None:
        out["grad_rtol"] = _worst(_grad_errors(grads, ref.first_grads, "max"))
    if grads is not None and tol.get("grad_l2_rtol") is not None:
        out["grad_l2_rtol"] = _worst(_grad_errors(grads, ref.first_grads, "l2"))
    if run.get("params") is not None:
        key = "param_atol" if "param_atol" in tol else "param_move_rtol"
        out[key] = _worst(_param_errors(run["params"], ref.params, key, init))
    return out


def assert_parity(run: dict, ref: Any, precision: str = "fp32",
                  init: dict[str, torch.Tensor] | None = None) -> None:
    """A run (`losses`, `grad_norms`, and where it has them `ranks`, `params`,
    `first_grads`) against the reference (plait.train.reference.Reference), within the
    stated tolerances: loss and grad norm (before clipping) at every step of every rank,
    each first-step gradient tensor, every final parameter. bf16 needs `init` (the initial
    weights) for its movement bound."""
    tol = PARITY_TOLERANCES[precision]
    for key, (err, where) in parity_errors(run, ref, precision, init).items():
        assert err <= tol[key], (f"{precision}: {where}: {key.removesuffix('_rtol')} error "
                                 f"{err:.3e} > {tol[key]:.1e} (steps {len(ref.losses)})")


def _grad_errors(grads: dict, ref: dict, kind: str) -> list[tuple[float, str]]:
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    errs = []
    for name, g in ref.items():
        diff = grads[name].float() - g.float()
        if kind == "max":
            errs.append((float(diff.abs().max()) / (float(g.abs().max()) or 1.0), name))
        else:
            errs.append((float(diff.norm()) / (float(g.float().norm()) or 1.0), name))
    return errs


def _param_errors(params: dict, ref: dict, key: str, init: dict | None
                  ) -> list[tuple[float, str]]:
    assert set(params) == set(ref), set(params) ^ set(ref)
    errs = []
    for name, r in ref.items():
        p, r = params[name].float(), r.float()
        if key == "param_atol":
            errs.append((float((p - r).abs().max()), name))
            continue
        # relative to how far the reference itself moved this tensor
        assert init is not None, "bf16 parity needs the initial weights (init=...)"
        moved = float((r - init[name].float()).norm())
        errs.append((float((p - r).norm()) / moved, name))
    return errs
