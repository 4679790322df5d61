"""Expert parallel: each rank of an `ep` group holds n_experts / ep of every MoE layer's
routed experts and exchanges tokens with the others by all-to-all
(plait/parallel/expert.py; Lepikhin et al. 2020, GShard). It is not an axis of the rank
grid: it is laid over the ranks that hold parameter copies (the replica axes), cut into
`ep` groups of consecutive ranks (different experts) and `edp` groups (the same experts,
whose gradients are summed)."""

from __future__ import annotations

from plait.dims.record import Config, Dimension, ModelShape, Planned, Setting, divisors_text
from plait.schedule.registry import SCHEDULES

DISPATCHES = ("assignment", "token")


def laid_ranks(group: str, replicas: list[int], i: int, laid: dict[str, int]) -> list[int]:
    """The ranks of `group` holding replica position i, with `replicas` the replica ranks
    in order: "ep" = positions with the same i // ep, "edp" = the same i % ep (the copies
    of the same experts), "edp_shard" = the copies inside i's hybrid-sharding shard group
    (plait/dims/dp_replicate.py: ZeRO shards experts over it; all of edp without one)."""
    ep = laid["ep"]
    if group == "ep":
        return replicas[(i // ep) * ep:(i // ep + 1) * ep]
    if group == "edp":
        return replicas[i % ep::ep]
    shard = len(replicas) // laid.get("dp_replicate", 1)
    return [r for j, r in enumerate(replicas) if j // shard == i // shard and j % ep == i % ep]



def problems(cfg: Config) -> list[str]:
    """ep against the model's experts and the replica ranks it is laid over, and the MoE
    settings that do not survive a split sequence or a two-copy pipeline."""
    m, p = cfg.model, cfg.parallel
    if not m.n_experts:
        return [f"parallel.ep={p.ep} needs an MoE model (model.n_experts > 0, e.g. --model "
                "tiny-moe); use ep=1"] if p.ep > 1 else []
    n, replicas = m.n_experts, p.dp * p.cp
    checks = [
        (n % p.ep != 0, f"parallel.ep={p.ep} does not divide the {n} experts; use one of "
         f"{divisors_text(n)}"),
        (replicas % p.ep != 0, f"parallel.ep={p.ep} does not divide dp*cp={replicas}"
         " (expert parallel is laid over the data-parallel ranks); use one of "
         f"{divisors_text(replicas)}"),
        (m.capacity_factor is not None and (p.cp > 1 or (p.sp and p.tp > 1)),
         "model.capacity_factor drops tokens per whole sequence, which cp > 1 or sequence "
         "parallel split over ranks; use dropless routing (capacity_factor=none), or cp=1 "
         "and sp=false"),
        (m.bias_update_rate > 0 and p.pp > 1 and p.schedule in SCHEDULES
         and SCHEDULES[p.schedule].chains > 1,
         f"model.bias_update_rate with schedule {p.schedule} (two copies of each block see "
         "different micro-batches, their loads are not summed yet); use another schedule"),
        (p.dp_replicate > 1 and replicas % p.dp_replicate == 0
         and (replicas // p.dp_replicate) % p.ep,
         f"parallel.ep={p.ep} with dp_replicate={p.dp_replicate}: ZeRO shards the experts "
         f"inside each shard group of dp*cp/dp_replicate={replicas // p.dp_replicate} "
         f"ranks, which ep must divide; use ep one of "
         f"{divisors_text(replicas // p.dp_replicate)}, or a smaller dp_replicate"),
        (p.ep_dispatch not in DISPATCHES,
         f"parallel.ep_dispatch={p.ep_dispatch!r}; use 'assignment' or 'token'"),
    ]
    return [msg for bad, msg in checks if bad]


def plan_sizes(sizes: list[int], shape: ModelShape, ranks_per_node: int) -> list[int]:
    """The planner's ep, of the divisors of the replicas: those dividing the experts (1
    for a dense model)."""
    return [e for e in sizes if shape.experts % e == 0] if shape.moe else [1]


def plan_problems(lay: Planned, shape: ModelShape) -> list[str]:
    """A planned ep against the experts and the replicas it is laid over."""
    ep, replicas = lay.sizes["ep"], lay.replicas
    if shape.moe and (shape.experts % ep or replicas % ep):
        return [f"ep={ep} must divide the {shape.experts} experts and dp*cp={replicas}"]
    if not shape.moe and ep != 1:
        return [f"ep={ep} needs an MoE model (--experts); use ep=1"]
    return []


DIMENSION = Dimension(
    name="ep", title="expert parallel", strategy="plait.parallel.expert", splits="experts",
    axis=False, checkpoint="owned", laid_groups=("ep", "edp_shard", "edp"), laid_ranks=laid_ranks,
    settings=(Setting("ep_dispatch", DISPATCHES, "expert parallel's all-to-all: a row per "
                      "(token, expert) assignment or per token and destination rank "
                      "(parallel.ep_dispatch, default assignment)"),),
    color="#8c564b", help="expert-parallel size", problems=problems,
    plan_sizes=plan_sizes, plan_problems=plan_problems,
)
