"""Will the ranks' model states fit in this machine's memory? Asked before any rank starts.

On the CPU every rank of a machine holds its parameters, gradients and optimizer states
in that machine's RAM. Their bytes come from the planner's model of plait's runtime
(`plait.plan.runtime_memory_sizes.rank_sizes`: the same numbers `plait plan` and the dry run's
prediction use, exact for plait's CPU runtime): a lower bound on what the run needs, since
activations, the data and the interpreter come on top. A run whose model states alone
exceed the memory the kernel reports available is refused with the numbers and what to
change, instead of swapping the machine to a halt or being killed by the OOM killer
after minutes. On CUDA the states live in device memory: not this check's business.
"""

from __future__ import annotations

from collections.abc import Iterable

from plait.config import Config
from plait.device.host import mem_available_bytes
from plait.dims import DEFAULT_ORDER
from plait.plan.runtime_memory_sizes import rank_sizes, zero_ranks

GIB = 2**30


def model_state_bytes(cfg: Config, rank: int) -> dict[str, float]:
    """Parameters, gradients and optimizer states of global rank `rank` (its pipeline
    stage's shards), in bytes, at their most during a step. Gradients: ZeRO-2/3 hold at
    most their shard, but whole gradients under pp (they accumulate over a stage's
    micro-batches); ZeRO-3 with `parallel.zero3_gather = "step"` holds every unit gathered
    beside its shard."""
    p = cfg.parallel
    inside = 1  # ranks inside a pipeline stage: the axes before pp in the default order
    for name in DEFAULT_ORDER[:DEFAULT_ORDER.index("pp")]:
        inside *= getattr(p, name)
    pp_rank = (rank // inside) % p.pp
    sz = rank_sizes(cfg, pp_rank, 0)
    grads = sz.grad_shards if p.zero >= 2 and p.pp == 1 else sz.grads_full
    gathered = sum(sz.padded.values()) * sz.pb if p.zero == 3 and p.zero3_gather == "step" \
        else 0.0
    # post-validation's copy of the optimizer states lives from one update to the next check
    return {"parameters": sz.params + gathered, "gradients": grads,
            "optimizer states": sz.optim + sz.snapshot}


def host_memory_problem(cfg: Config, ranks: Iterable[int], device_type: str = "cpu",
                        available: int | None = None) -> str | None:
    """Why the model states of `ranks` (the ranks on this machine) cannot fit in
    `available` bytes (default: MemAvailable now), naming the numbers and the fix; None
    when they can, on CUDA, and where the kernel does not say."""
    if device_type != "cpu":
        return None
    available = mem_available_bytes() if available is None else available
    if available is None:
        return None
    ranks = list(ranks)
    per_rank = [model_state_bytes(cfg, r) for r in ranks]
    need = sum(sum(s.values()) for s in per_rank)
    if need <= available or not ranks:
        return None
    biggest = max(per_rank, key=lambda s: sum(s.values()))
    parts = ", ".join(f"{k} {v / GIB:,.2f}" for k, v in biggest.items())
    fixes = ["a smaller --model"]
    p = cfg.parallel
    if zero_ranks(cfg) > 1 and p.zero < 3:
        fixes.append(f"--zero 3 (shards all three over the {zero_ranks(cfg)} data-parallel "
                     "ranks it shards over)")
    fixes.append("more machines (torchrun -m plait.train on each), so that each holds "
                 "fewer ranks")
    return (f"the model states of the {len(ranks)} rank(s) on this machine need "
            f"{need / GIB:,.2f} GiB of memory (the largest rank: {parts} GiB; activations "
            f"come on top), but only {available / GIB:,.2f} GiB is available (MemAvailable "
            f"in /proc/meminfo); use " + ", or ".join(fixes))
