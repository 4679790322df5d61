"""Hybrid sharding: ZeRO shards inside groups of `dp_shard` replica ranks and the groups
are replicas of each other (Zhao et al. 2023, "PyTorch FSDP", section 3.2.2: hybrid
sharding; DeepSpeed's ZeRO++ hpZ, Wang et al. 2023). Each layer's all-gathers and
reduce-scatters stay inside a shard group (a node, when it fits one), and only the
already-reduced gradient shards cross between groups, all-reduced over `dp_replicate`
(plait/parallel/replicas/sync.py's `EveryStep`). dp = dp_shard x dp_replicate.

It is not an axis of the rank grid: it is laid over the replica ranks (the product of the
replica axes, plait/dims/__init__.py, in the mesh's order), cut into `dp_shard` groups of
consecutive positions (S = replicas / dp_replicate of them: where the sequence is split
too, the shard group spans that split, as ZeRO over the whole replica group does) and
`dp_replicate` groups (the ranks at the same position in every shard group: they hold
the same shard)."""

from __future__ import annotations

from plait.dims.record import Config, Dimension, ModelShape, Planned, divisors_text


def laid_ranks(group: str, replicas: list[int], i: int, laid: dict[str, int]) -> list[int]:
    """The ranks of `group` ("dp_shard" or "dp_replicate") holding replica position i,
    with `replicas` the replica ranks in order."""
    shard = len(replicas) // laid["dp_replicate"]
    if group == "dp_shard":
        return replicas[(i // shard) * shard:(i // shard + 1) * shard]
    return replicas[i % shard::shard]


def problems(cfg: Config) -> list[str]:
    """dp_replicate against dp, dp_shard and ZeRO: it only cuts ZeRO's shard groups."""
    p = cfg.parallel
    m, n = p.dp_replicate, p.dp_shard
    if m < 1 or n < 0:
        return [f"parallel.dp_replicate={m} must be >= 1 and parallel.dp_shard={n} >= 1 "
                "(0: dp / dp_replicate)"]
    checks = [
        (p.dp % m != 0, f"parallel.dp_replicate={m} does not divide dp={p.dp}; use one of "
         f"{divisors_text(p.dp)}, or give dp = dp_shard x dp_replicate (--dp-shard N)"),
        (n > 0 and n * m != p.dp, f"parallel.dp_shard={n} x dp_replicate={m} = {n * m} "
         f"but dp={p.dp}; give dp = dp_shard x dp_replicate (or leave dp out)"),
        # fault tolerance makes each replica a unit of failure: plain data-parallel copies
        # (torchft's FT-DDP) are a layout of their own there
        (m > 1 and p.zero == 0 and not p.fault_tolerance, f"parallel.dp_replicate={m} with "
         "zero=0: nothing is sharded, every rank already holds a replica; use --dp alone, "
         "--zero 1, 2 or 3 to shard inside each dp_shard group, or --fault-tolerance to make "
         "each replica a unit of failure"),
    ]
    return [msg for bad, msg in checks if bad] + fault_tolerance_problems(cfg)


def fault_tolerance_problems(cfg: Config) -> list[str]:
    """--fault-tolerance: replicas to lose, what is summed across them only (ZeRO's
    shards, or with zero=0 each replica's whole gradients), nothing else that crosses them
    (plait/parallel/fault_tolerance.py)."""
    p, m = cfg.parallel, cfg.model
    if not p.fault_tolerance:
        return []
    checks = [
        (p.dp_replicate < 2, f"--fault-tolerance needs replicas to lose: dp_replicate="
         f"{p.dp_replicate}; give --dp-replicate 2 or more (each is a unit of failure)"),
        (p.replica_timeout_s <= 0, f"parallel.replica_timeout_s={p.replica_timeout_s} must "
         "be > 0 (seconds a replica may keep the others waiting)"),
        (not 1 <= p.min_replicas <= p.dp_replicate, f"parallel.min_replicas={p.min_replicas} "
         f"must be between 1 and dp_replicate={p.dp_replicate}"),
        (m.n_experts > 0, "--fault-tolerance with MoE is not built (expert-parallel groups "
         "and the balancing statistics cross replicas); train MoE with --max-restarts"),
        (p.optimizer_sync != "barrier", "--fault-tolerance with optimizer_sync="
         f"{p.optimizer_sync!r} is not built; use --optimizer-sync barrier"),
    ]
    return [msg for bad, msg in checks if bad]


def replica_layout(cfg: Config) -> Config:
    """One fault-tolerant replica's own configuration: its dp_shard ranks as dp, no
    replicate groups, its share of the global batch (the job's global batch is what the
    loss is normalised by: plait/train/loop.py)."""
    import dataclasses

    p = cfg.parallel
    shard = p.dp // p.dp_replicate
    parallel = dataclasses.replace(p, dp=shard, dp_shard=0, dp_replicate=1,
                                   fault_tolerance=False, min_replicas=1)
    train = dataclasses.replace(cfg.train, global_batch=cfg.train.global_batch // p.dp_replicate)
    return dataclasses.replace(cfg, parallel=parallel, train=train)


def plan_sizes(sizes: list[int], shape: ModelShape, ranks_per_node: int) -> list[int]:
    """The planner's dp_replicate, of the divisors of the replicas (`sizes`, the last is
    all of them): 1 (ZeRO over every replica) and the split whose shard group is the
    replica ranks one node holds (`ranks_per_node`, for a laid dimension the consecutive
    replica ranks inside a node), where that is more than one and less than all: ZeRO's
    per-layer collectives on the node's links, only the shards' all-reduce across nodes."""
    replicas, node = sizes[-1], ranks_per_node
    if 1 < node < replicas and replicas % node == 0:
        return [1, replicas // node]
    return [1]


def plan_problems(lay: Planned, shape: ModelShape) -> list[str]:
    """A planned dp_replicate against dp, ZeRO and the experts' split (the planner's side
    of `problems`)."""
    m, dp = lay.sizes["dp_replicate"], lay.sizes["dp"]
    if dp % m:
        return [f"dp_replicate={m} must divide dp={dp}; use one of {divisors_text(dp)}"]
    out = []
    if m > 1 and lay.zero == 0:
        out.append(f"dp_replicate={m} with zero=0: nothing is sharded; use --zero 1, 2 or 3 "
                   "(ZeRO inside each shard group), or dp_replicate=1")
    shard = lay.replicas // m
    if m > 1 and shard % lay.expert_split:
        out.append(f"dp_replicate={m}: ZeRO shards the experts inside each shard group of "
                   f"{shard} replica ranks, which the expert-parallel size "
                   f"{lay.expert_split} must divide; use a smaller dp_replicate or "
                   "expert-parallel size")
    return out


DIMENSION = Dimension(
    name="dp_replicate", title="hybrid sharding", strategy="plait.parallel.zero",
    splits="batch", axis=False, checkpoint="copies",
    laid_groups=("dp_shard", "dp_replicate"), laid_ranks=laid_ranks, color="#2ca02c",
    help="hybrid sharding's replica groups: dp = dp_shard x dp_replicate; ZeRO shards "
    "inside each dp_shard group and all-reduces the reduced shards over these",
    problems=problems, plan_sizes=plan_sizes, plan_problems=plan_problems,
)
