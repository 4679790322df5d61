"""`plait calibrate`'s tensor-parallel floor: what a tp rank's layer costs the rank in CPU
beyond the planner's per-operation and per-collective prices (plait/plan/profile.py's
`fit_tp_floor`, plait/plan/estimate.py's `_chunk_times`).

Why: at the dispatch floor (a model whose GEMMs cost nothing) tp halves a layer's FLOPs,
not its operations, and SP's gathers and scatters add reshapes, the collectives' Python
calls and the backend's own threads (gloo's event loop, its copies). Measured on a
2-core machine (docs/planner_cpu.md, shared cores): the `tiny`
model's tp=2 rank used 18.6-20.7 ms of CPU a step on its main thread where the planner
gave it 10.4, and gloo's threads 7.8 ms a step with a core per rank but 16.7 ms with four
ranks on the two cores (its event loop spins while a pair's lock is held, longer when the
holder is descheduled), which calls timed alone (the profile's `comm_cpu`) cannot see.

Those are CPU a rank's compute competes with only where its host's cores are shared (on
a core of its own the backend's threads run beside the rank's compute, and the CPU
closed loop's tp2 SP step, planned without this, is within 15 %: docs/planner_cpu.md), so
the floor's training step (steps.runtime_steps: plait's own step, tp = 2, SP
on, 1 and 2 layers, recompute none and selective) is trained on twice as many forked
gloo ranks as the host has cores (dp = cores x tp 2, every core held by two ranks, as
the emulated cluster's four ranks on two cores are), each rank in a session of its own
as torchrun starts ranks (`_own_session`), where that is at most 8 ranks. Per
step the rank's process CPU seconds (every thread: the caller's and gloo's), and the tp
calls and payload bytes its ledger recorded; the fit (plait/plan/profile.py's
fit_tp_floor) takes the 2-layer minus the 1-layer step (one layer's) less what the
planner prices for it, and the 1-layer step less one such layer and the planner's price
for the rest (the embedding, head and loss, the optimizer, every call outside the
layers: `outside`). Measured here (4 ranks on 2 cores, four runs): one layer
7.5-9.6 ms with recompute none, 13.2-15.3 ms with selective, of which the prices hold
about 6 and 11.5 ms (0.5 ms of comm_cpu for each of its 10 and 13 tp calls).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any

from plait.calibrate.steps import runtime_steps

TP = 2
MODES = ("none", "selective")
# the most ranks the floor runs on (twice the host's cores): a small job
SHARED_MAX_RANKS = 8


def _own_session() -> None:
    """Put this rank in a session of its own, as torchrun starts every rank
    (`start_new_session`): with autogroup scheduling (Linux's default on many distributions)
    each session is one scheduling entity, and ranks in sessions of their own pay more
    CPU waiting at collectives (pure compute does not change): with 4 ranks on 2 cores
    the floor's selective step cost about a fifth more CPU in sessions of their own, and
    that is what a rank of `plait train` or the emulated cluster pays. Out of the
    terminal's process group a Ctrl-C no longer reaches the rank itself, so it ends with
    `plait calibrate` (die_with_parent), as the harness's daemonic children do on a normal
    exit."""
    from plait.launch.local import die_with_parent

    with contextlib.suppress(OSError):  # already a session leader: nothing to change
        os.setsid()
    die_with_parent()


def _floor_rank(rank: int, world: int, steps: int, repeats: int) -> dict[str, Any]:
    """This rank's floor steps at tp = 2 over every (recompute, layers), the runs
    interleaved `repeats` times (a drift of the shared machine lands on both layer
    counts): the mean and median process CPU seconds of every run's steps after its
    first, pooled, and the calls and their payload bytes per step, tp's and all (the
    ledger's: the dp all-reduces of the gradients, the norm, the logged loss too)."""
    _own_session()
    times: dict[str, list[float]] = {}
    out: dict[str, Any] = {}
    for _ in range(repeats):
        for mode in MODES:
            for layers in (1, 2):
                _, run, mesh = runtime_steps(layers, steps, False, mode, tp=TP, world=world,
                                             clock=time.process_time)
                times.setdefault(f"{mode}_{layers}", []).extend(run[1:])
                every = mesh.ledger.for_step()
                recs = [r for r in every if r.dim == "tp"]
                out[f"{mode}_{layers}"] = {
                    "tp_calls": len(recs) / steps,
                    "tp_payload_bytes": sum(r.payload for r in recs) / steps,
                    "calls": len(every) / steps,
                    "payload_bytes": sum(r.payload for r in every) / steps}
    for key, row in out.items():
        # the mean: a step's CPU is work, its disturbed steps' (gloo's spin) paid in full
        row.update(cpu_seconds=statistics.fmean(times[key]),
                   cpu_median_seconds=statistics.median(times[key]))
    return {"rows": out, "own_session": os.getsid(0) == os.getpid()}


def _run(world: int, steps: int, repeats: int) -> dict[str, Any]:
    """The floor on `world` forked ranks: each (mode, layers) row the mean over the ranks."""
    from plait.launch.forked import run_ranks

    ranks = run_ranks(_floor_rank, world, steps, repeats, timeout=180.0)
    first = ranks[0]["rows"]
    rows = {key: {field: statistics.fmean(r["rows"][key][field] for r in ranks)
                  for field in first[key]} for key in first}
    return {"world": world, "tp": TP, "steps": steps, "repeats": repeats,
            "own_sessions": all(r["own_session"] for r in ranks), **rows}


def measure_tp_floor(quick: bool, cores: int | None = None) -> dict[str, Any]:
    """The floor on 2 x the host's cores (at least 2) forked ranks, where that is at most
    SHARED_MAX_RANKS (else {}); `cores`: the ranks' cores (default this process's
    affinity)."""
    cores = cores or len(os.sched_getaffinity(0))
    world = max(TP, 2 * cores)
    if world > SHARED_MAX_RANKS:
        return {}
    steps, repeats = (6, 1) if quick else (12, 3)
    return {"cores": cores, "shared": _run(world, steps, repeats)}
