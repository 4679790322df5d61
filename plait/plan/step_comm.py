"""The communication inside a layout's step, as the planner models it: tensor-parallel
collectives per layer, context parallel's ring K/V and expert parallel's all-to-all with
the part of each not hidden behind compute, and the pipeline's sends. `evaluate`
(plait/plan/estimate.py) builds the step from these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.config import FIRST_BUCKET_MB, ParallelConfig
from plait.parallel.pipeline.registry import schedule_spec
from plait.plan import comm, memory
from plait.plan.basis import Basis, ChunkTimes, Layout, Training
from plait.plan.compute import Efficiency, Num
from plait.plan.hardware import Cluster
from plait.plan.runtime_comm import layer_visits, tp_collectives
from plait.plan.schedule_facts import facts
from plait.plan.shape import Shape

TP_COLLECTIVES_FWD = 2  # per layer in the forward: attention's and the MLP's (Megatron)


@dataclass
class LayerComm:
    """The collectives inside a layer (tp, cp, ep) and their exposed time per layer."""

    colls: list[comm.Collective]
    t_ar: Num  # one tp all-reduce (or all-gather + reduce-scatter pair)
    tp_count: Num  # tp collectives per step on one rank
    cp_exp_f: Num
    cp_exp_b: Num
    ep_exp_f: Num
    ep_exp_b: Num


def layer_comm(shape: Shape, cluster: Cluster, lay: Layout, eff: Efficiency,
                b: Basis, ends: tuple[Num, Num] | None = None) -> LayerComm:
    """`ends`: tp_collectives' (one pipeline rank's embedding and head micro-batches)."""
    colls: list[comm.Collective] = []
    gpu, gpn = cluster.gpu, cluster.gpus_per_node
    tp_intra = comm.intra_node(b.strides["tp"], b.tp, gpn)
    bw, al = comm.link(gpu, tp_intra, eff.link_efficiency)
    s_tp = b.tokens * shape.hidden * b.e
    t_ar, _ = comm.all_reduce(s_tp, b.tp, bw, al)
    # a recomputed forward replays the forward's 2 (Megatron's count; plait's full and its
    # selective both re-issue them, math's selective only redoes the attention core)
    n_tp_bwd = 2 + (0 if lay.runtime_mode() == "none" else 2)
    tp_count = (TP_COLLECTIVES_FWD + n_tp_bwd) * b.rank_layers * b.m
    # the collectives listed are the runtime's (plait/plan/runtime_comm.py); the time above
    # keeps Megatron's count, on which the step-time model was calibrated
    tp_list = tp_collectives(shape, cluster, lay, eff, b, ends)
    colls.extend(tp_list)
    if eff.runtime_comm and tp_list:  # a measured profile: the runtime's list, its time
        total = sum(c.count * c.time_each for c in tp_list)  # spread over Megatron's slots
        t_ar = np.where(tp_count > 0, total / np.maximum(tp_count, 1e-30), t_ar)
    # the recomputed forward's exchanges (plait's full and selective both redo attention
    # and the all-to-alls)
    replay = 0 if lay.runtime_mode() == "none" else 1
    cp_exp_f, cp_exp_b = _cp_exposure(shape, cluster, eff, b, colls, lay.cp_mode, replay)
    ep_exp_f, ep_exp_b = _ep_exposure(shape, cluster, eff, b, colls, replay)
    return LayerComm(colls, t_ar, tp_count, cp_exp_f, cp_exp_b, ep_exp_f, ep_exp_b)


def _cp_exposure(shape: Shape, cluster: Cluster, eff: Efficiency, b: Basis,
                 colls: list[comm.Collective], mode: str = "ring", replay: int = 0
                 ) -> tuple[Num, Num]:
    """Exposed (forward, backward) K/V time per layer; appends cp's collective. Ring: the
    local K/V chunk hops cp-1 times forward, K/V and dK/dV 2(cp-1) times backward, each
    hop hidden behind a block's compute; all-gather: K/V gathered forward, dK/dV
    reduce-scattered backward, not overlapped (plait/parallel/context.py)."""
    cp_intra = comm.intra_node(b.strides["cp"], b.cp, cluster.gpus_per_node)
    bw, al = comm.link(cluster.gpu, cp_intra, eff.link_efficiency)
    s_kv = 2 * b.tokens * shape.kv_dim * b.e / b.tp
    if mode == "allgather":
        t_ag = comm.gather_like(b.cp * s_kv, b.cp, bw, al)
        if np.any(b.cp > 1):
            n = layer_visits(b)
            colls.append(comm.Collective("cp", "all-gather (K/V)", b.cp * s_kv,
                                         (1 + replay) * n, b.cp, cp_intra, t_ag,
                                         (1 + replay) * n * t_ag, "none: before attention"))
            colls.append(comm.Collective("cp", "reduce-scatter (dK/dV)", b.cp * s_kv, n,
                                         b.cp, cp_intra, t_ag, n * t_ag,
                                         "none: after attention's backward"))
        return t_ag, t_ag
    t_kv = np.where(b.cp > 1, (b.cp - 1) * comm.p2p(s_kv, bw, al), 0.0)
    cp_exp_f = np.maximum(t_kv - b.lt.attn_fwd, 0)
    cp_exp_b = np.maximum(2 * t_kv - 2 * b.lt.attn_fwd, 0)
    if np.any(b.cp > 1):
        n = (3 + replay) * (b.cp - 1) * layer_visits(b)
        colls.append(comm.Collective("cp", "p2p (ring K/V)", s_kv, n, b.cp, cp_intra,
                                     comm.p2p(s_kv, bw, al), (cp_exp_f + cp_exp_b)
                                     * layer_visits(b), "attention core compute"))
    return cp_exp_f, cp_exp_b


def _ep_exposure(shape: Shape, cluster: Cluster, eff: Efficiency, b: Basis,
                 colls: list[comm.Collective], replay: int = 0) -> tuple[Num, Num]:
    """Exposed (forward, backward) expert all-to-all time per layer (0 for a dense
    model); appends ep's collective."""
    if not shape.moe:
        return 0.0, 0.0
    tp, cp, pp, ep = b.tp, b.cp, b.pp, b.ep
    span = np.where(ep <= cp, tp * ep, tp * cp * pp * ep / cp)
    ep_intra = span <= cluster.gpus_per_node
    bw, al = comm.link(cluster.gpu, ep_intra, eff.link_efficiency)
    s_a2a = b.tokens * shape.top_k * shape.hidden * b.e / b.moe_split
    t_a2a = comm.gather_like(s_a2a, ep, bw, al)
    if facts(b.sched).pairs_forward_with_backward and np.all(pp > 1):
        ep_exp_f = np.maximum(2 * t_a2a - b.lt.forward, 0)  # hidden by the paired chunk
        ep_exp_b = np.maximum(2 * t_a2a - 2 * b.lt.forward, 0)
        how = "the other micro-batch's compute (DualPipe)"
    else:
        ep_exp_f, ep_exp_b = 2 * t_a2a, 2 * t_a2a
        how = "none: on the critical path"
    if np.any(ep > 1):
        n = (4 + 2 * replay) * layer_visits(b)  # dispatch + combine, both ways
        colls.append(comm.Collective("ep", "all-to-all", s_a2a, n, ep, ep_intra, t_a2a,
                                     (ep_exp_f + ep_exp_b) * layer_visits(b), how))
    return ep_exp_f, ep_exp_b



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


def pp_p2p(shape: Shape, cluster: Cluster, eff: Efficiency, b: Basis,
           colls: list[comm.Collective], sp: bool = False, sends: Num | None = None) -> Num:
    """One pipeline send's time (0 without a pipeline); appends pp's collective. `sends`:
    one pipeline rank's per step (its lowered schedule's); None: the busiest rank's."""
    pp_intra = comm.intra_node(b.strides["pp"], b.pp, cluster.gpus_per_node)
    bw, al = comm.link(cluster.gpu, pp_intra, eff.link_efficiency)
    # the time: Megatron's scatter/gather optimisation sends 1/tp of the activation per
    # rank (Narayanan et al. 2021, sec. 4.1), on which the calibration was fitted. The
    # list: plait's runtime sends the whole activation from every tp rank (not built
    # yet), under SP already split over tp
    t_pp = np.where(b.pp > 1, comm.p2p(b.tokens * shape.hidden * b.e / b.tp, bw, al), 0.0)
    if np.any(b.pp > 1):
        s_pp = b.tokens * shape.hidden * b.e / (b.tp if sp else 1.0)
        n = pp_sends_per_microbatch(b.sched, b.pp, b.v) * b.m if sends is None else sends
        colls.append(comm.Collective("pp", "send (activations, gradients)", s_pp, n, 2,
                                     pp_intra, comm.p2p(s_pp, bw, al), 0.0,
                                     "inside the pipeline timeline (simulated)"))
    return t_pp


def dp_exposed_time(cluster: Cluster, train: Training, lay: Layout, eff: Efficiency,
                    b: Basis, ct: ChunkTimes, pr: Num, colls: list[comm.Collective],
                    over_ep: bool = False) -> Num:
    """Exposed data-parallel / ZeRO time per step (`pr`: parameters on the rank, synced
    over dp x cp, or over its edp part when `over_ep`: routed experts); appends the
    collectives (dim "dp" or "edp")."""
    pb, gb, _ = memory.state_bytes(train.precision, train.optimizer)
    m = b.m
    # the gradients are reduced over dp x cp: inside a node when both dims' groups are
    span = np.maximum(np.where(b.dp > 1, b.span("dp"), 1), np.where(b.cp > 1, b.span("cp"), 1))
    dp_intra = span <= cluster.gpus_per_node
    bw, al = comm.link(cluster.gpu, dp_intra, eff.link_efficiency)
    g_bytes, p_bytes = pr * gb, pr * pb
    # one micro-batch on this rank: the compute that can hide a collective, as much as
    # the machine overlaps the two (a measured profile's; all of it on a GPU)
    f_mb = b.cpr * ct.f_c * eff.comm_overlap
    b_mb = b.cpr * (ct.i_c + ct.w_c) * eff.comm_overlap
    n = b.dp * b.cp / (b.ep if over_ep else 1.0)
    # ZeRO's collectives, one per unit (plait/parallel/zero_units.py: ZeRO-3 the
    # embedding, each block, final norm, head; ZeRO-1/2 runs of them of BUCKET_BYTES; a
    # pipeline stage is one unit) under a measured profile; one collective of all the
    # bytes in Megatron's count
    modules = b.rank_layers + 3
    if lay.zero in (1, 2):
        modules = np.minimum(modules, np.maximum(np.ceil(p_bytes / BUCKET_BYTES), 1.0))
    units = np.where(b.pp > 1, 1.0, modules) if eff.runtime_comm else 1.0
    t_ar_dp, _ = comm.all_reduce(g_bytes, n, bw, al)
    t_rs = units * comm.gather_like(g_bytes / units, n, bw, al)
    t_ag = units * comm.gather_like(p_bytes / units, n, bw, al)
    # the runtime's last gradient collective starts when the backward is done: nothing
    # hides it (ZeRO-0: the last bucket's all-reduce, plait/parallel/data.py; ZeRO: the
    # embedding unit's reduce-scatter); Megatron's count hides all behind the backward
    last_ar, last_rs = 0.0, 0.0
    if eff.runtime_comm:
        last_ar = comm.all_reduce(last_bucket_bytes(g_bytes), n, bw, al)[0]
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
        k = m if lay.zero == 2 else 1
        exp_rs = k * np.maximum(t_rs - b_mb, last_rs)
        dp_colls.append(("reduce-scatter (grads)", g_bytes, k, t_rs, exp_rs,
                         "each backward" if lay.zero == 2 else "last backward", k))
        dp_colls.append(("all-gather (params)", p_bytes, 1, t_ag,
                         np.maximum(t_ag - f_mb, 0), "first forward", 1))
    else:
        dp_colls.append(("all-gather (params, fwd+bwd)", p_bytes, 2 * m, t_ag,
                         m * np.maximum(t_ag - f_mb, 0) + m * np.maximum(t_ag - b_mb / 2, 0),
                         "the layer before (prefetch)", 2 * m))
        dp_colls.append(("reduce-scatter (grads)", g_bytes, m, t_rs,
                         m * np.maximum(t_rs - b_mb / 2, last_rs), "the next layer's backward",
                         m))
    dp_exposed = 0.0
    for op, size, count, t_each, exp, how, blocking in dp_colls:
        exp = np.where(n > 1, exp, 0.0)
        dp_exposed = dp_exposed + exp
        if np.any(n > 1):
            per_unit = op != "all-reduce (grads)"  # ZeRO's: `units` calls of size / units
            colls.append(comm.Collective("edp" if over_ep else "dp", op,
                                         size / units if per_unit else size,
                                         np.asarray(count, dtype=float)
                                         * (units if per_unit else 1.0), n, dp_intra,
                                         t_each / units if per_unit else t_each, exp, how,
                                         blocking=np.asarray(blocking, dtype=float)))
    if eff.runtime_comm and not over_ep:
        dp_exposed = dp_exposed + step_end_collectives(cluster, lay, eff, b, colls)
    return dp_exposed


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
                         colls: list[comm.Collective]) -> Num:
    """Exposed seconds of the runtime's all-reduces after the micro-batches (counted in
    "dp comm (exposed)"): the grad norm's partial sums over the world when any parameter
    is sharded (ZeRO, tp, pp, ep: plait/parallel/replicated.py) and the logged loss over
    pp, cp and dp (plait/train/loop.py); latency-bound, on the critical path. Where dp is
    the whole mesh and the norm has an all-reduce, the logged loss rides in it (one call of
    two float64s: GradSyncOptimizer.grad_norm's `summed_with`)."""
    world = b.tp * b.pp * b.dp * b.cp
    sharded = (lay.zero >= 1) | (b.tp > 1) | (b.pp > 1) | (b.ep > 1)
    folded = sharded & (world == b.dp) & (world > 1)
    total = 0.0
    for dim, n, what, size in (
            ("world", np.where(sharded, world, 1.0), "grad norm",
             np.where(folded, 2 * STEP_END_BYTES, STEP_END_BYTES)),
            ("pp", b.pp, "logged loss", STEP_END_BYTES),
            ("cp", b.cp, "logged loss", STEP_END_BYTES),
            ("dp", np.where(folded, 1.0, b.dp), "logged loss", STEP_END_BYTES)):
        span = world if dim == "world" else b.span(dim)
        intra = span <= cluster.gpus_per_node
        bw, al = comm.link(cluster.gpu, intra, eff.link_efficiency)
        t, _ = comm.all_reduce(size, n, bw, al)
        total = total + t
        if np.any(n > 1):
            colls.append(comm.Collective(dim, f"all-reduce ({what}, float64)", size,
                                         np.where(n > 1, 1.0, 0.0), n, intra, t, t,
                                         "none: after the micro-batches"))
    return total


SYNC_TERM = "collective sync (waits)"  # the step-time breakdown's line for sync_seconds


def _power_law(segment: Num, xs: tuple[float, ...], ys: tuple[float, ...]) -> Num:
    """y = y0 (L / L0)^p through the measured points (x > 0; two: exactly, more: least
    squares in log-log, so one noisy point moves the law, not a piece of it); a single
    point, or a y of 0: proportional to L through the largest; 0 where nothing was
    measured. p is held to [0, 1], between a value that does not grow with the compute
    (0) and one proportional to it (1), y0 then refitted: noisy points can say less, or
    more, than either."""
    pts = [(c, w) for c, w in zip(xs, ys, strict=True) if c > 0]
    seg = np.maximum(np.asarray(segment, dtype=float), 0.0)
    if not pts:
        return 0.0 * seg
    if len(pts) == 1 or min(w for _, w in pts) <= 0 or len({c for c, _ in pts}) == 1:
        c1, w1 = max(pts)
        return max(w for _, w in pts) / c1 * seg
    lx, ly = np.log([c for c, _ in pts]), np.log([w for _, w in pts])
    p = float(np.clip(np.polyfit(lx, ly, 1)[0], 0.0, 1.0))
    return np.exp(np.mean(ly - p * lx)) * seg ** p


def desync_wait(segment: Num, eff: Efficiency) -> Num:
    """The mean wait for the last rank of a group at a collective after `segment` seconds
    of compute on each rank since their last one: a power law (`_power_law`) through the
    profile's measured points (independent disturbances would give p = 1/2)."""
    return _power_law(segment, eff.desync_compute, eff.desync_wait)


def sync_after(segment: Num, eff: Efficiency) -> Num:
    """The mean seconds a blocking collective takes past its alpha-beta price once the
    last rank has arrived, after `segment` seconds of compute: the profile's per-segment
    measurements through the same power law (measured here: it grows with the compute
    before the call; heavy-tailed, so a mean over every call: docs/planner.md, "The sync
    extra is a mean"), or its one mean
    `sync_extra` where those are not in the profile."""
    if len(eff.sync_after) != len(eff.desync_compute) or not eff.sync_after:
        return eff.sync_extra + 0.0 * np.asarray(segment, dtype=float)
    return _power_law(segment, eff.desync_compute, eff.sync_after)


def blocking_calls(colls: list[comm.Collective],
                   bytes_cap: float = float("inf")) -> tuple[Num, Num]:
    """(calls, their bytes, each call's held at `bytes_cap`) a step the rank waits on at
    once, over groups of more than one rank: every listed call but the pipeline's sends
    (the simulated timeline holds them) and those a collective says overlap compute
    (`Collective.blocking`: ZeRO's prefetched gathers, reduce-scatters completed behind
    later layers)."""
    calls, nbytes = 0.0, 0.0
    for c in colls:
        if c.dim != "pp" or not c.op.startswith("send"):
            n = np.where(np.asarray(c.group) > 1, c.count if c.blocking is None
                         else c.blocking, 0.0)
            calls, nbytes = calls + n, nbytes + n * np.minimum(c.size, bytes_cap)
    return np.asarray(calls, dtype=float), np.asarray(nbytes, dtype=float)


def sync_seconds(eff: Efficiency, colls: list[comm.Collective], compute: Num) -> Num:
    """Seconds a step's synchronising collectives cost beyond their alpha-beta time: each
    of the K blocking calls per step (`blocking_calls`) waits for the last rank after its
    share of the step's compute, L = compute / K (the ranks' jitter), and then pays the
    measured extra after that arrival at that L, and sync_per_byte for each byte of its
    message up to the largest size measured (plait calibrate's measure_sync; held beyond
    it: the closed loop's tp 2 calls of 2 KB and 1 MB paid the same extra,
    1.4-2.1 ms, where the line from 1 to 128 KiB gave the 1 MB ones 6 ms more)."""
    calls, nbytes = blocking_calls(colls, eff.sync_bytes_measured)
    segment = np.asarray(compute, dtype=float) / np.maximum(calls, 1.0)
    return calls * (sync_after(segment, eff) + desync_wait(segment, eff)) \
        + eff.sync_per_byte * nbytes
