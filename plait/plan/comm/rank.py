"""The collectives one pipeline rank issues in a step, from the runtime's own partition.

`evaluate` (plait/plan/estimate.py) describes a layout's most loaded rank with L / (pp v)
layers a chunk: the closed forms the search scores thousands of layouts with. The
runtime's partitioner balances stages by cost (plait/parallel/pipeline/partition.py), so
the rank that holds the head and the loss holds fewer layers (llama3-8b at pp = 4: 6 of
32 on the last stage), and the ends differ from the middle: only the first stage's rank
runs the embedding, only the last's the head and the loss, an end rank sends one way.
A dry run (plait/observe/dry_run.py) compares one rank's ledger with that rank's own
collectives: the same formulas (plait/plan/comm/layer.py, step.py) fed what the rank holds
in the runtime (`RankPart`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from plait.dims import REPLICA_AXES, REPLICAS
from plait.plan import memory
from plait.plan.basis import Layout, basis_of
from plait.plan.comm import price
from plait.plan.comm.layer import layer_comm
from plait.plan.comm.step import (
    block_scales_sync,
    dp_exposed_time,
    dualpipe_copies,
    pp_p2p,
    pp_sends_of_rank,
)
from plait.plan.comm.zero import gathered_by_stage, gathered_bytes
from plait.plan.compute import float8_gathered_weights
from plait.plan.estimate import chunk_times
from plait.plan.from_config import config_inputs
from plait.plan.runtime_memory_sizes import rank_stages
from plait.schedule.ir import split_backwards
from plait.schedule.registry import natural_virtual_stages, schedule_spec

if TYPE_CHECKING:
    from plait.config import Config
    from plait.plan.shape import Shape


@dataclass(frozen=True)
class RankPart:
    """What one pipeline rank holds and runs in a step, as the runtime builds it."""

    pp_rank: int
    layers: tuple[int, ...]  # the model layers of the rank's stages (both copies: DualPipe)
    embedding_microbatches: int  # micro-batches per step through the embedding here
    head_microbatches: int  # ... through the head and the loss here
    sends: int  # pipeline sends per step (the placement's closed form: step.py)


def rank_part(cfg: Config, pp_rank: int) -> RankPart:
    """The runtime's partition and schedule seen from pipeline rank `pp_rank`."""
    if not 0 <= pp_rank < cfg.parallel.pp:
        raise ValueError(f"pipeline rank {pp_rank}: the layout has pp={cfg.parallel.pp}")
    sched, stages = rank_stages(cfg, pp_rank)
    layers: list[int] = []
    emb = head = 0
    for s, (a, z, first, last) in sorted(stages.items()):
        layers.extend(range(a, z))
        n = len(sched.microbatches_of(s))
        emb += n if first else 0
        head += n if last else 0
    p = cfg.parallel
    v = natural_virtual_stages(p.schedule, p.virtual_stages)
    sends = pp_sends_of_rank(p.schedule, p.pp, v, p.microbatches, pp_rank)
    return RankPart(pp_rank, tuple(layers), emb, head, sends)


def rank_params(shape: Shape, tp: float, expert_split: float, part: RankPart
                ) -> tuple[float, float]:
    """(dense, routed-expert) parameters on the rank: its layers (an MoE model's leading
    `dense_layers` dense), the embedding and the head where its stages hold them."""
    return _params_of(shape, tp, expert_split, part.layers, bool(part.embedding_microbatches),
                      bool(part.head_microbatches))


def _params_of(shape: Shape, tp: float, expert_split: float, layers, embedding: bool,
               head: bool) -> tuple[float, float]:
    t = memory.param_terms(shape, tp, expert_split)
    dense = expert = 0.0
    for layer in layers:
        if shape.moe and layer < shape.dense_layers:
            dense += t.dense_layer
        else:
            dense += t.layer
            expert += t.expert if shape.moe else 0.0
    dense += t.embedding if embedding else 0.0
    dense += t.head if head else 0.0
    return float(dense), float(expert)


def zero3_gathered_on_rank(cfg: Config, pp_rank: int, lay: Layout, shape: Shape, tp: float,
                           expert_split: float) -> tuple[float, float]:
    """(dense, routed-expert) parameters ZeRO-3 all-gathers per step on pipeline rank
    `pp_rank`, stage by stage of the runtime's partition (plait/plan/comm/zero.py)."""
    p = cfg.parallel
    sched, stages = rank_stages(cfg, pp_rank)
    recompute = cfg.train.recompute != "none"
    split = split_backwards(sched, pp_rank, recompute)[1] if p.pp > 1 else set()
    emb = memory.param_terms(shape, tp, expert_split).embedding
    dense, expert = [], []
    for s, (a, z, first, last) in stages.items():
        d, e = _params_of(shape, tp, expert_split, range(a, z), first, last)
        m, n_split = len(sched.microbatches_of(s)), sum(1 for st, _ in split if st == s)
        dense.append((m, n_split, d, emb if first else 0.0))
        expert.append((m, n_split, e, 0.0))
    return gathered_by_stage(lay, p.pp, dense), gathered_by_stage(lay, p.pp, expert)


def linear_gathered_on_rank(cfg: Config, pp_rank: int, lay: Layout, shape: Shape,
                            tp: float) -> float:
    """Block-linear weights ZeRO-3 all-gathers per step on pipeline rank `pp_rank` (each
    stage's layers' `float8_gathered_weights`), as `zero3_gathered_on_rank` counts parameters."""
    sched, stages = rank_stages(cfg, pp_rank)
    recompute = cfg.train.recompute != "none"
    split = split_backwards(sched, pp_rank, recompute)[1] if cfg.parallel.pp > 1 else set()
    per_layer = float(float8_gathered_weights(shape, tp))
    return gathered_by_stage(lay, cfg.parallel.pp, [
        (len(sched.microbatches_of(s)), sum(1 for st, _ in split if st == s),
         (z - a) * per_layer, 0.0) for s, (a, z, _, _) in stages.items()])


def rank_collectives(cfg: Config, pp_rank: int) -> list[price.Collective]:
    """Pipeline rank `pp_rank`'s collectives per step (every rank of its stage issues the
    same; the experts' all-to-alls at a balanced routing): `evaluate`'s list, for that
    rank."""
    shape, cluster, train, lay, eff = config_inputs(cfg)
    part = rank_part(cfg, pp_rank)
    b = replace(basis_of(shape, cluster, train, lay, eff), rank_layers=float(len(part.layers)))
    ends = (float(part.embedding_microbatches), float(part.head_microbatches))
    lc = layer_comm(shape, cluster, lay, eff, b, ends)
    colls = lc.colls
    ct = chunk_times(shape, cluster, lay, eff, b, lc)
    pp_p2p(shape, cluster, eff, b, colls, lay.sp, sends=float(part.sends))
    dense, expert = rank_params(shape, b.tp, b.expert_split, part)
    g_dense, g_expert = zero3_gathered_on_rank(cfg, pp_rank, lay, shape, b.tp, b.expert_split)
    # as in `evaluate`: dense parameters sync over the replicas, routed experts over edp
    g_bytes = None
    if lay.zero == 3 and train.precision in memory.LINEAR_GATHER_BYTES:  # fp8's weights
        g_bytes = gathered_bytes(train, g_dense,
                                 linear_gathered_on_rank(cfg, pp_rank, lay, shape, b.tp))
    dp_exposed_time(cluster, train, lay, eff, b, ct, dense, colls, gathered=g_dense,
                    gathered_bytes=g_bytes)
    block_scales_sync(cluster, train, lay, eff, b, shape, colls)
    if shape.moe:
        dp_exposed_time(cluster, train, lay, eff, b, ct, expert, colls, experts=True,
                        gathered=g_expert)
    if schedule_spec(b.sched).chains > 1 and np.any(b.pp > 1):
        colls.append(dualpipe_copies(cluster, train, eff, b, dense, expert, lay.zero))
    return colls


def bytes_by_dim(collectives: list[price.Collective], expert_split: int
                 ) -> dict[str, float]:
    """The planner's payload bytes per step per dim (size x count), named as
    plait.ledger.data_bytes_by_dim names the ledger's: with the experts whole on every
    rank (expert_split = 1) the routed experts' gradients sync with the rest (one group,
    the dense parameters' replica group, "dp" or "dp_cp": the runtime's one bucketed
    sync, or hybrid sharding's one set of units); DualPipe's copy swap is "pp_copies"."""
    out: dict[str, float] = {}
    dense = REPLICAS if any(c.dim == REPLICAS for c in collectives) else REPLICA_AXES[0]
    whole = {"edp": dense, "edp_shard": "dp_shard"} if expert_split == 1 else {}
    for c in collectives:
        dim = whole.get(c.dim, c.dim)
        dim = "pp_copies" if "copies" in c.op else dim
        out[dim] = out.get(dim, 0.0) + float(c.size * c.count)
    return out


def rank_bytes_by_dim(cfg: Config, pp_rank: int) -> dict[str, float]:
    """`bytes_by_dim` of pipeline rank `pp_rank`'s collectives (`rank_collectives`)."""
    expert_split = config_inputs(cfg)[3].expert_split
    return bytes_by_dim(rank_collectives(cfg, pp_rank), expert_split)
