"""The collectives around the layers, once or per micro-batch in a step: the pipeline's
sends (and DualPipe's swap of its copies' gradients), the gradient synchronisation over
the replicas (data parallel and ZeRO; the routed experts' over the ranks holding the same
experts) and the step's closing all-reduces (the grad norm, the logged loss).

Counts per step on the most loaded rank (s = one micro-batch's activation on a rank):

  pp                  a send per stage boundary the rank's stages cross, forward and
                      backward; the full activation (plait does not split it over tp; SP
                      already has); DualPipe also swaps the two copies' gradients
  dp, dp_cp (edp)     ZeRO-0: the gradients all-reduced once, bucketed; ZeRO-1/2: reduce-
                      scattered (each micro-batch's under ZeRO-2 without pp; once a step
                      with pp) and the parameters all-gathered after the update; ZeRO-3:
                      all-gathered before each forward and backward (comm/zero.py),
                      reduce-scattered as ZeRO-2's
  dp_shard            hybrid sharding: ZeRO's collectives as above, inside a shard group
  (edp_shard),        of replicas; after the last backward each unit's reduced gradient
  dp_replicate        shard all-reduced over the ranks holding copies of it, once a step
  step end            8-byte all-reduces: the grad norm's partial sums over the world,
                      the logged loss over the dimensions that sum it
"""

from __future__ import annotations

import numpy as np

from plait.config import FIRST_BUCKET_MB, ParallelConfig
from plait.dims import DIMENSIONS, LOSS_SUMMED, REPLICA_AXES, replica_group
from plait.plan import fp8, memory
from plait.plan.basis import Basis, ChunkTimes, Layout, Training
from plait.plan.comm import price
from plait.plan.comm.zero import zero3_gathered, zero_reduce_scatters
from plait.plan.compute import Efficiency, Num
from plait.plan.hardware import Cluster
from plait.plan.schedule_facts import facts
from plait.plan.shape import Shape
from plait.schedule.registry import schedule_spec


def pp_sends_per_microbatch(sched: str, pp: Num, v: Num) -> Num:
    """Sends of one micro-batch on the busiest rank: a stage boundary its stages cross,
    forward and backward. Looping placements (stage s on rank s mod pp): v each way on a
    middle rank, one fewer at pp = 2 (both ranks are ends); V shapes (stages r and
    2pp-1-r on rank r): the turn is local, 2 each way in the middle, 1 at pp = 2;
    DualPipe: each micro-batch runs one chain, like v = 1."""
    spec, two = schedule_spec(sched), np.asarray(pp) == 2
    if spec.chains > 1:
        v = 1.0
    elif facts(sched).head_on_first_rank:  # V shape
        return np.where(two, 2.0, 4.0)
    return 2.0 * v - np.where(two, 1.0, 0.0)


def pp_sends_of_rank(sched: str, pp: int, v: int, m: int, rank: int) -> int:
    """Pipeline sends per step on pipeline rank `rank`, from the placement alone: each of
    its stages sends every micro-batch's activation forward unless it ends the chain or
    the next stage is its own, and its gradient backward unless it starts the chain or
    the previous stage is its own. Looping (stage s on rank s mod pp, v stages a rank):
    2v - [first rank] - [last rank] per micro-batch; V (stages r and 2pp-1-r): twice
    [not first] + [not last], the turn local; DualPipe's two chains, each m / 2
    micro-batches, reversed on one: v = 1 for both."""
    if pp < 2:
        return 0
    ends = int(rank == 0) + int(rank == pp - 1)
    if schedule_spec(sched).chains == 1 and facts(sched).head_on_first_rank:  # V shape
        return m * 2 * (2 - ends)
    v = 1 if schedule_spec(sched).chains > 1 else v
    return m * (2 * v - ends)


def pp_p2p(shape: Shape, cluster: Cluster, eff: Efficiency, b: Basis,
           colls: list[price.Collective], sp: bool = False, sends: Num | None = None) -> Num:
    """One pipeline send's time (0 without a pipeline); appends pp's collective. `sends`:
    one pipeline rank's per step (its lowered schedule's); None: the busiest rank's."""
    pp_intra = price.intra_node(b.strides["pp"], b.pp, cluster.gpus_per_node)
    bw, al = price.link(cluster.gpu, pp_intra, eff.link_efficiency)
    # the time: Megatron's scatter/gather optimisation sends 1/tp of the activation per
    # rank (Narayanan et al. 2021, sec. 4.1), on which the calibration was fitted. The
    # list: plait's runtime sends the whole activation from every tp rank (not built
    # yet), under SP already split over tp
    t_pp = np.where(b.pp > 1, price.p2p(b.tokens * shape.hidden * b.e / b.tp, bw, al), 0.0)
    if np.any(b.pp > 1):
        s_pp = b.tokens * shape.hidden * b.e / (b.tp if sp else 1.0)
        n = pp_sends_per_microbatch(b.sched, b.pp, b.v) * b.m if sends is None else sends
        colls.append(price.Collective("pp", "send (activations, gradients)", s_pp, n, 2,
                                     pp_intra, price.p2p(s_pp, bw, al), 0.0,
                                     "inside the pipeline timeline (simulated)"))
    return t_pp


def dp_exposed_time(cluster: Cluster, train: Training, lay: Layout, eff: Efficiency,
                    b: Basis, ct: ChunkTimes, pr: Num, colls: list[price.Collective],
                    experts: bool = False, gathered: Num | None = None,
                    gathered_bytes: Num | None = None) -> Num:
    """Exposed data-parallel / ZeRO time per step (`pr`: parameters on the rank, synced
    over the replicas, or with `experts` routed experts', over the replicas that hold the
    same experts, "edp"; `gathered`: the parameters ZeRO-3 all-gathers per step, by
    default `zero3_gathered`'s; `gathered_bytes`: their bytes where not the parameter's
    (float8 block linears: comm/zero.py gathered_bytes)); appends the collectives (dim
    `zero_group`'s: "dp" ("dp_cp" under context parallel) or "edp"; with hybrid sharding
    ZeRO's run inside a shard group, "dp_shard" or "edp_shard", and the shards'
    all-reduce over "dp_replicate": `shard_copies_sync`)."""
    pb, gb, _ = memory.state_bytes(train.precision, train.optimizer)
    dim, n, dp_intra, nics = zero_group(cluster, lay, b, experts)
    bw, al = price.link(cluster.gpu, dp_intra, eff.link_efficiency, nics)
    g_bytes, p_bytes = pr * gb, pr * pb
    # one micro-batch on this rank: the compute that can hide a collective, as much as
    # the machine overlaps the two (a measured profile's; all of it on a GPU)
    # (none where the stack reduces after the backward: Training.stack.dp_overlap)
    hide = eff.comm_overlap * (1.0 if train.stack.dp_overlap else 0.0)
    f_mb = b.cpr * ct.f_c * hide
    b_mb = b.cpr * (ct.i_c + ct.w_c) * hide
    # ZeRO's collectives, one per unit (plait/parallel/zero_units.py: ZeRO-3 the
    # embedding, each block, final norm, head; ZeRO-1/2 runs of them of BUCKET_BYTES, at
    # least one a pipeline stage) under a measured profile; one collective of all the
    # bytes in Megatron's count
    modules = b.rank_layers + 3
    if lay.zero in (1, 2):
        modules = np.minimum(modules, np.maximum(np.ceil(p_bytes / BUCKET_BYTES), b.cpr))
    units = modules if eff.runtime_comm else 1.0
    t_ar_dp, _ = price.all_reduce(g_bytes, n, bw, al)
    t_rs = units * price.gather_like(g_bytes / units, n, bw, al)
    t_ag = units * price.gather_like(p_bytes / units, n, bw, al)
    # the runtime's last gradient collective starts when the backward is done: nothing
    # hides it (ZeRO-0: the last bucket's all-reduce, plait/parallel/data.py; ZeRO: the
    # embedding unit's reduce-scatter); Megatron's count hides all behind the backward
    last_ar, last_rs = 0.0, 0.0
    if eff.runtime_comm:
        last_ar = price.all_reduce(last_bucket_bytes(g_bytes), n, bw, al)[0]
        last_rs = t_rs / units
    # the last value: calls a step the rank waits on at once (`Collective.blocking`): of
    # bucketed DP's all-reduces the last bucket's, issued when the backward ends; of ZeRO's
    # reduce-scatters the last unit's of each round (the others complete behind the rest
    # of the backward, plait/parallel/zero.py); of ZeRO-1/2's parameter all-gathers, issued
    # together after the update, the first unit's (each later one is waited on before its
    # unit's forward, behind the units before it); of ZeRO-3's all-gathers the first
    # unit's of each forward and each backward (every later unit's was prefetched)
    dp_colls: list[tuple[str, Num, Num, Num, Num, str, Num]] = []
    if lay.zero == 0:
        exp = np.maximum(t_ar_dp - b_mb, last_ar)
        dp_colls.append(("all-reduce (grads)", g_bytes, 1, t_ar_dp, exp, "last backward", 1))
    elif lay.zero in (1, 2):
        k = zero_reduce_scatters(lay, b)
        exp_rs = k * np.maximum(t_rs - b_mb, last_rs)
        dp_colls.append(("reduce-scatter (grads)", g_bytes, k, t_rs, exp_rs,
                         "each backward" if lay.zero == 2 else "last backward", k))
        dp_colls.append(("all-gather (params)", p_bytes, 1, t_ag,
                         np.maximum(t_ag - f_mb, 0), "first forward", 1))
    else:
        # each gather of the rank's parameters counted whole (pp: a fraction of them)
        every = (zero3_gathered(lay, b, pr) if gathered is None else gathered) / np.where(
            pr > 0, pr, 1.0)
        if gathered_bytes is not None:  # float8 block linears: fewer bytes a gather
            p_bytes = gathered_bytes / np.where(every > 0, every, 1.0)
            t_ag = units * price.gather_like(p_bytes / units, n, bw, al)
        dp_colls.append(("all-gather (params, fwd+bwd)", p_bytes, every, t_ag,
                         every / 2 * (np.maximum(t_ag - f_mb, 0)
                                      + np.maximum(t_ag - b_mb / 2, 0)),
                         "the layer before (prefetch)", every))
        k = zero_reduce_scatters(lay, b)
        dp_colls.append(("reduce-scatter (grads)", g_bytes, k, t_rs,
                         k * np.maximum(t_rs - b_mb / 2, last_rs), "the next layer's backward",
                         k))
    dp_exposed = _listed(dp_colls, dim, n, units, dp_intra, colls)
    if lay.zero >= 1:
        dp_exposed = dp_exposed + shard_copies_sync(cluster, lay, eff, b, g_bytes / n,
                                                    units, colls)
    if eff.runtime_comm and not experts:
        dp_exposed = dp_exposed + step_end_collectives(cluster, lay, eff, b, colls)
    return dp_exposed


def zero_group(cluster: Cluster, lay: Layout, b: Basis, experts: bool = False
               ) -> tuple[str, Num, Num, Num]:
    """(name, ranks, inside a node, its ranks in each node: price.rails) of the group
    ZeRO's collectives (or ZeRO-0's all-reduce) run over: the replicas, named as the mesh
    names them (`plait.dims.replica_group`: "dp", or "dp_cp" under context parallel;
    routed experts: the replicas holding the same experts, "edp"), or with hybrid sharding
    one shard group of them, consecutive replica ranks ("dp_shard", "edp_shard": the
    runtime's names, plait/dims/dp_replicate.py). A batch of layouts names every layout's
    group by the name of its largest sizes (any hybrid one: the hybrid name; the sizes
    are each layout's own)."""
    hybrid = bool(np.any(np.asarray(b.shard_copies) > 1))
    replicas = replica_group({d: int(np.max(b.sizes[d])) for d in REPLICA_AXES})
    name = "edp_shard" if experts and hybrid else "edp" if experts else \
        "dp_shard" if hybrid else replicas
    span = price.replica_block_span(lay.order, b.sizes, b.strides, b.zero_split)
    n = b.zero_split / (b.expert_split if experts else 1.0)
    return (name, n, span <= cluster.gpus_per_node,
            price.rails(b.zero_split, span, cluster.gpus_per_node, cluster.gpu.nics_per_node))


def shard_copies_sync(cluster: Cluster, lay: Layout, eff: Efficiency, b: Basis,
                      shard_bytes: Num, units: Num, colls: list[price.Collective]) -> Num:
    """Hybrid sharding's exposed seconds: once a step, after the last reduce-scatter, each
    unit's reduced gradient shard (`shard_bytes` in all, on this rank) all-reduced over
    the ranks holding copies of it ("dp_replicate": the same position in every shard
    group, spanning the whole replica group: usually across nodes). Issued together and
    waited on before the update, nothing hides them (plait/parallel/replicas/sync.py's
    `EveryStep`); appends the collective. 0 without copies."""
    copies = np.asarray(b.shard_copies, dtype=float)
    if not np.any(copies > 1):
        return 0.0
    span = price.replica_block_span(lay.order, b.sizes, b.strides, b.replicas)
    intra = span <= cluster.gpus_per_node
    bw, al = price.link(cluster.gpu, intra, eff.link_efficiency,
                        price.rails(copies, span, cluster.gpus_per_node,
                                    cluster.gpu.nics_per_node))
    t_each, _ = price.all_reduce(shard_bytes / units, copies, bw, al)
    count = np.where(copies > 1, units, 0.0)
    colls.append(price.Collective("dp_replicate", "all-reduce (grad shards)",
                                 shard_bytes / units, count, copies, intra, t_each,
                                 count * t_each, "none: after the last backward",
                                 blocking=np.where(copies > 1, 1.0, 0.0)))
    return count * t_each


def block_scales_sync(cluster: Cluster, train: Training, lay: Layout, eff: Efficiency,
                      b: Basis, shape: Shape, colls: list[price.Collective]) -> Num:
    """ZeRO-3 under float8's blockwise recipe: once a step, before the first gather, one
    all-reduce (max) of the amaxes of the rank's float8 weight blocks (`fp8.weight_blocks`
    a layer) over ZeRO's group (the dense parameters'), the scales every rank casts its
    shard with (plait/parallel/zero_fp8_blocks.py); waited on at once. Appends it; its
    seconds (0 under any other recipe or stage)."""
    if lay.zero != 3 or not train.fp8_block:
        return 0.0
    dim, n, intra, nics = zero_group(cluster, lay, b)
    bw, alpha = price.link(cluster.gpu, intra, eff.link_efficiency, nics)
    size = fp8.weight_blocks(shape, b.tp, train.fp8_block) * b.rank_layers * \
        fp8.scale_bytes(train.precision)
    t_each, _ = price.all_reduce(size, n, bw, alpha)
    live = np.where(n > 1, 1.0, 0.0)
    colls.append(price.Collective(dim, "all-reduce (float8 block scales)", size, live, n,
                                 intra, t_each, live * t_each, "none: before the first gather",
                                 blocking=live))
    return live * t_each


def _listed(dp_colls: list[tuple[str, Num, Num, Num, Num, str, Num]], dim: str, n: Num,
            units: Num, intra: Num, colls: list[price.Collective]) -> Num:
    """`dp_colls` (op, size, count, seconds each, exposed, overlap, blocking) appended to
    `colls` as `dim`'s collectives (ZeRO's as `units` calls of size / units each); their
    exposed seconds, summed."""
    exposed = 0.0
    for op, size, count, t_each, exp, how, blocking in dp_colls:
        exp = np.where(n > 1, exp, 0.0)
        exposed = exposed + exp
        if np.any(n > 1):
            per_unit = op != "all-reduce (grads)"
            colls.append(price.Collective(dim, op, size / units if per_unit else size,
                                         np.asarray(count, dtype=float)
                                         * (units if per_unit else 1.0), n, intra,
                                         t_each / units if per_unit else t_each, exp, how,
                                         blocking=np.asarray(blocking, dtype=float)))
    return exposed


BUCKET_BYTES = ParallelConfig.bucket_mb * 2**20  # bucketed DP's default bucket (data.py)
FIRST_BUCKET_BYTES = FIRST_BUCKET_MB * 2**20  # its smaller first bucket (data.py)


def last_bucket_bytes(g_bytes: Num) -> Num:
    """About the bytes of bucketed DP's last bucket, the one nothing hides: after the
    first bucket (FIRST_BUCKET_BYTES) every bucket holds BUCKET_BYTES; a gradient within
    the first bucket is one bucket."""
    return np.where(g_bytes <= FIRST_BUCKET_BYTES, g_bytes,
                    np.minimum(g_bytes - FIRST_BUCKET_BYTES, BUCKET_BYTES))


STEP_END_BYTES = 8  # the grad norm's partial sum and the logged loss, one float64 each


def step_end_collectives(cluster: Cluster, lay: Layout, eff: Efficiency, b: Basis,
                         colls: list[price.Collective]) -> Num:
    """Exposed seconds of the runtime's all-reduces after the micro-batches (counted in
    "dp comm (exposed)"): the grad norm's partial sums over the world when any parameter
    is sharded (ZeRO, or a dimension whose ranks hold different parameters:
    plait/parallel/replicated.py) and the logged loss over the dimensions that sum it, in
    their order (plait/train/loop.py); latency-bound, on the critical path. Where dp is
    the whole mesh and the norm has an all-reduce, the logged loss rides in it (one call of
    two float64s: GradSyncOptimizer.grad_norm's `summed_with`)."""
    world = b.world
    sharded = lay.zero >= 1
    for d in DIMENSIONS:
        if not d.replicates_params:
            sharded = sharded | (b.sizes[d.name] > 1)
    folded = sharded & (world == b.dp) & (world > 1)
    total = 0.0
    calls = [("world", np.where(sharded, world, 1.0), "grad norm",
              np.where(folded, 2 * STEP_END_BYTES, STEP_END_BYTES))]
    calls += [(name, np.where(folded, 1.0, b.dp) if name == "dp" else b.sizes[name],
               "logged loss", STEP_END_BYTES) for name in LOSS_SUMMED]
    for dim, n, what, size in calls:
        span = world if dim == "world" else b.span(dim)
        intra = span <= cluster.gpus_per_node
        bw, al = price.link(cluster.gpu, intra, eff.link_efficiency)
        t, _ = price.all_reduce(size, n, bw, al)
        total = total + t
        if np.any(n > 1):
            colls.append(price.Collective(dim, f"all-reduce ({what}, float64)", size,
                                         np.where(n > 1, 1.0, 0.0), n, intra, t, t,
                                         "none: after the micro-batches"))
    return total


def dualpipe_copies(cluster: Cluster, train: Training, eff: Efficiency, b: Basis,
                    dense: Num, experts: Num = 0.0, zero: int = 0) -> price.Collective:
    """DualPipe's swap of the two copies' gradients with the mirror rank: every gradient
    the rank holds (`dense` and routed `experts` parameters), in the compute dtype, once a
    step (a send; the receive is the mirror's send); under ZeRO its gradient shards
    (the dense over the replicas, the experts over the ranks holding the same ones)."""
    _, gb, _ = memory.state_bytes(train.precision, train.optimizer)
    intra = price.intra_node(b.strides["pp"], b.pp, cluster.gpus_per_node)
    bw, al = price.link(cluster.gpu, intra, eff.link_efficiency)
    if zero >= 1:
        dense, experts = dense / b.replicas, experts * b.expert_split / b.replicas
    size = (dense + experts) * gb
    return price.Collective("pp", "send (DualPipe copies' gradients)", size, 1.0, 2, intra,
                           price.p2p(size, bw, al), price.p2p(size, bw, al),
                           "none: after the last backward")
