"""Memory of plait's own (eager, CPU) runtime through one training step, moment by moment:
`predict_memory(cfg, kernels="eager")`. The planner needs two memory models: memory.py's
closed form scores the search's ~10^5 layouts at once for a GPU stack (fused kernels,
flash attention, NCCL); this one walks one configuration's schedule through the eager
runtime's temporaries (fp32 norm inputs, unfused SwiGLU buffers, gloo's chunks, bucket
copies) and returns the categories *at the peak moment* of the most loaded rank: what the
runtime's `MemoryTracker` measures (live tensor bytes: params / grads / optimizer / comm /
activations), within 5 %. Where both describe the same bytes, the model states at the
step's end, they agree (tests/test_plan_memory_agree.py).

Moments considered, per pipeline rank, walking the rank's action list of the schedule
(`build_schedule`; pp = 1 is the one-stage F, B per micro-batch case):
  * loss forward / loss backward of each micro-batch on the stage holding the head: every
    in-flight micro-batch's saved activations, plus the loss's transients;
  * the first MLP backward of each layer in each B: saved activations so far, the output
    gradient, SwiGLU's gradient buffers, the gradients accumulated so far, ZeRO-3's two
    gathered blocks and ZeRO-2/3's reduce-scatter in flight;
  * ZeRO-2/3: the flat gradient of each unit as its reduce-scatter is launched;
  * the end of backward: data-parallel buckets (flat copies of the gradients) / ZeRO-1's
    reduce-scatter of each unit;
  * the global grad norm and the optimizer step (chunked foreach temporaries);
  * post-validation (`parallel.optimizer_sync`): the update holds the optimizer states'
    copy, and the next step's forward-only prefix (`lower.speculative_prefix`) holds it
    and the step's gradients until the check at its end drops both.
Every term is derived in docs/planner_memory.md. The per-layer saved
tensors come from plait/plan/activations.py: one formula for our block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.dims import DIMENSIONS
from plait.optim import CHUNK as OPT_CHUNK  # elements per foreach chunk
from plait.plan.activations import FP32
from plait.plan.runtime_memory_sizes import (
    CATEGORIES,
    Moment,
    RankSizes,
    rank_sizes,
    rank_stages,
)

if TYPE_CHECKING:
    from plait.config import Config


def _loss_forward_moment(sz: RankSizes, st: int, mb: int, acc: float,
                         base: float, held: float = 0.0) -> Moment:
    """`held`: post-validation's copy of the optimizer states, in the prefix (`acc` then
    holds the previous step's gradients)."""
    mo = Moment(f"loss forward (stage {st}, mb {mb})",
                sz.states(acc, opt_extra=held, shards=sz.shards_posted(mb, [])))
    mo.bytes["activations"] += base
    mo.bytes["logits"] = sz.loss_fwd
    return mo


def _loss_backward_moments(sz: RankSizes, st: int, mb: int, acc: float, base: float,
                           first_b: bool) -> list[Moment]:
    """The loss's backward, then the head's (first_b: the stage's first B this step)."""
    shards = sz.shards_posted(mb, [])  # no unit's reduce-scatter before the head's
    mo = Moment(f"loss backward (stage {st}, mb {mb})", sz.states(acc, shards=shards))
    mo.bytes["activations"] += base
    mo.bytes["logits"] = sz.loss_bwd
    # head backward: d(logits) in the compute dtype replaces the kept softmax, the
    # head's weight gradient (a temporary when accumulated) and d(input) are new
    head_g = sum(sz.sh["head"]) * sz.pb
    fresh = head_g if (sz.zero >= 2 or first_b) else 0.0
    gathered = (sz.padded["head"] + sz.padded["norm"]) * sz.pb if sz.zero == 3 else 0.0
    head = Moment(f"head backward (stage {st}, mb {mb})",
                  sz.states(acc + fresh, gathered=gathered, shards=shards))
    e, tok = sz.e, sz.tok
    head.bytes["activations"] += (base - FP32 * tok * sz.sh["v_t"] + e * tok * sz.sh["h"]
                                  + head_g - fresh)
    head.bytes["logits"] = e * tok * sz.sh["v_t"]
    return [mo, head]


@dataclass(frozen=True)
class _Backward:
    """One B (or I) action of a stage, as its blocks' backward moments see it."""

    st: int
    mb: int
    first_b: bool  # the stage's first backward this step (gradients not yet allocated)
    others: float  # what the other in-flight (stage, micro-batch) pairs keep
    this_first: float  # this stage's embed ids/tokens and stage output
    grads_before: float  # gradients alive before the stage's blocks
    in_flight: float  # receive buffers posted ahead, input gradients being sent


def _backward_moments(sz: RankSizes, st: int, mb: int, live: dict, first_b: bool,
                      acc: float, base: float, in_flight: float) -> list[Moment]:
    """The loss and head backward (last stage), then the blocks of this stage, last first."""
    a, z, _, last = sz.stages[st]
    out = _loss_backward_moments(sz, st, mb, acc, base, first_b) if last else []
    grads_before = acc
    if first_b and sz.zero < 2 and last:
        grads_before += (sum(sz.sh["head"]) + sum(sz.sh["norm"])) * sz.pb
    bw = _Backward(st, mb, first_b,
                   others=sum(v for key, v in live.items() if key != (st, mb)),
                   this_first=sz.stage_act(st, layers_kept=0) - sz.rope,
                   grads_before=grads_before, in_flight=in_flight)
    for j in range(z - 1, a - 1, -1):
        out += _block_backward_moments(sz, bw, j)
    return out


def _block_collective_bytes(sz: RankSizes, bw: _Backward, j: int):
    """(gathered, comm, chunks, rs_now, shards) while block j's backward runs: ZeRO-3's
    gathered blocks, the reduce-scatters in flight (their buffers and gloo's all-to-all chunks)
    and ZeRO-2/3's gradient shards (`RankSizes.shards_posted`)."""
    p, pb, padded = sz.cfg.parallel, sz.pb, sz.padded
    z = sz.stages[bw.st][1]
    gathered = comm = chunks = 0.0
    shards = None
    bucket, before = sz.first_bucket()  # bucketed DP's first all-reduce, posted early
    if before is not None and j < before and bw.mb == sz.n_micro - 1:
        comm = bucket
    if sz.zero == 3:  # block j and the prefetched unit before it, gathered whole
        gathered = (padded[f"layers.{j}"] + padded.get(
            f"layers.{j - 1}" if j > 0 else "embed", 0)) * pb
    rs_now = p.pp == 1 and p.dp > 1 and (sz.zero >= 2 or (sz.zero == 1
                                                           and bw.mb == sz.n_micro - 1))
    if rs_now:  # the units' reduce-scatters in flight, the last posted first
        done = sz.posted_before(z, j)
        comm, chunks = sz.reduce_scatters_in_flight(done, bw.mb)
        shards = sz.shards_posted(bw.mb, done)
    return gathered, comm, chunks, rs_now, shards


def _block_backward_moments(sz: RankSizes, bw: _Backward, j: int) -> list[Moment]:
    """Block j's first MLP backward (w2's, then SwiGLU's) and, ZeRO-2/3 (ZeRO-1 on the
    last micro-batch), its reduce-scatter launch."""
    a, z = sz.stages[bw.st][:2]
    st, mb, e, pb = bw.st, bw.mb, sz.e, sz.pb
    kept = j - a  # blocks before j still hold their saved tensors
    if sz.recompute:  # fp32: the recomputed block's first norm input is its checkpoint;
        # selective's saved outputs were handed to the recomputed graph (in layer_saved)
        block_input = e * sz.tok_l * sz.sh["h"]
        act_b = (sz.rope + bw.this_first + kept * sz.ckpt + (e != FP32) * block_input
                 + sz.layer_saved)
    else:
        act_b = sz.rope + bw.this_first + (kept + 1) * sz.layer_saved
    act_b += bw.in_flight
    gathered, comm, chunks, rs_now, shards = _block_collective_bytes(sz, bw, j)
    g = bw.grads_before + sz.unit_grads_after(z, j)
    if sz.zero < 2 and bw.first_b:
        g += (z - 1 - j) * sz.layer_numel * pb
    # w2's gradient is new (0/1: the first backward; 2/3: since the last
    # reduce-scatter); accumulated into an existing .grad it is gone by now
    fresh = sz.w2 if (sz.zero >= 2 or bw.first_b) else 0.0
    # (a) inside w2's backward: its weight gradient and d(product) are new, the
    # product is still saved; a gradient to be accumulated is a temporary
    # gloo's direct reduce-scatter receives all-to-all chunks: communication
    w2 = Moment(f"block {j} w2 backward (stage {st}, mb {mb})",
                sz.states(g + fresh, comm + chunks, gathered, shards=shards))
    w2.bytes["activations"] += bw.others + act_b + sz.dy + sz.dprod + (sz.w2 - fresh)
    # (b) SwiGLU's product rule: the product freed, d(silu out), d(w3 out) new
    swiglu = Moment(f"block {j} SwiGLU backward (stage {st}, mb {mb})",
                    sz.states(g + fresh, comm + chunks, gathered, shards=shards))
    swiglu.bytes["activations"] += bw.others + act_b + sz.mlp_bwd
    # (c) the MLP's norm backward, after w3's and w1's (RankSizes.mlp_norm_backward)
    out = [w2, swiglu, sz.mlp_norm_backward(f"block {j} MLP norm backward (stage {st}, mb {mb})",
                                            g, bw.first_b, bw.others + act_b, comm + chunks,
                                            gathered, shards)]
    if rs_now and f"layers.{j}" in sz.k:  # block j is its unit's first module
        out += _reduce_scatter_launch(sz, bw, j, g, comm + chunks, gathered, shards)
    return out


def _reduce_scatter_launch(sz: RankSizes, bw: _Backward, j: int, g: float, comm: float,
                           gathered: float, shards: float | None) -> list[Moment]:
    """Block j's gradients flattened, then its reduce-scatter posted (`comm`: what is
    already in flight; `shards`: ZeRO-2/3's gradient shards before it)."""
    u, pb = f"layers.{j}", sz.pb
    kept = j - sz.stages[bw.st][0]
    act = bw.others + bw.this_first + kept * (sz.ckpt if sz.recompute else sz.layer_saved)
    act_rs = act + sz.attn_norm_weight_grad()  # the block's last weight gradient
    g_rs = 0.0  # 2/3: .grad freed into the flat gradient
    if sz.zero == 1:
        g_rs = g + (sz.layer_numel * pb if bw.first_b else 0.0)
    # ZeRO-3 frees block j before posting: only the prefetched unit is whole
    gathered_rs = gathered - sz.padded[u] * pb if sz.zero == 3 else 0.0
    out_k = sz.k[u] * pb  # its output: ZeRO-2/3's shard when it is the step's first
    before = shards
    if shards is not None:
        shards, out_k = shards + out_k, 0.0
    mo = Moment(f"block {j} reduce-scatter launch (mb {bw.mb})",
                sz.states(g_rs, comm + 2 * sz.padded[u] * pb + out_k, gathered_rs,
                          shards=shards))
    mo.bytes["activations"] += act_rs
    # then the oldest in flight completes, and the norm's input gradient runs beside the
    # rest (the peak where the one completed is small: the final norm's)
    posted = [u, *sz.posted_before(sz.stages[bw.st][1], j)]
    after = Moment(f"block {j} attention norm input gradient (mb {bw.mb})", sz.states(
        g_rs, sum(sz.reduce_scatters_in_flight(posted, bw.mb)), gathered_rs, shards=shards))
    after.bytes["activations"] += act + sz.attn_norm_input_grad()
    if sz.zero < 2:
        return [mo, after]
    # ZeRO-2/3: the flat copy is made while the block's .grad tensors and (3) the block
    # itself are still whole: the peak of small micro-batches (one sequence, dp = 4:
    # measured one unit of comm and one of gradients above the launch)
    flat = Moment(f"block {j} gradients flattened (mb {bw.mb})",
                  sz.states(g + sz.layer_numel * pb, comm + sz.padded[u] * pb, gathered,
                            shards=before))
    flat.bytes["activations"] += act_rs
    return [flat, mo, after]


def rank_moments(cfg: Config, rank: int = 0, data_windows: int = 0) -> list[Moment]:
    """Every candidate peak moment of pipeline rank `rank` (its first dp/tp rank).

    `data_windows`: seq_len windows in the token file, when known: the data loader keeps an
    int64 permutation of them for the epoch (8 bytes each), alive through every step."""
    from plait.schedule.lower import lower, speculative_prefix

    sz = rank_sizes(cfg, rank, data_windows)
    sched, recv = sz.sched, sz.recv
    lowered = sched if sched.lowered else lower(sched)
    # post-validation: up to the cut (the forward-only prefix) the previous step's
    # gradients and the optimizer states' copy are alive; the check there drops both
    cut = speculative_prefix(lowered)[rank] if sz.snapshot else -1
    moments: list[Moment] = []
    live: dict[tuple[int, int], float] = {}  # (stage, mb) -> bytes held
    had_b: set[int] = set()  # stages with a backward done this step (grads accumulate)
    actions = lowered.actions[rank]
    last_b = max((i for i, a in enumerate(actions) if a.kind in ("B", "I")), default=-1)
    pending = 0.0  # receive buffers posted ahead of the compute that consumes them
    # Input gradients sent stay alive until the end of the step: gloo's send work never
    # reports completion before `wait()` (measured), and nothing later in the step proves the
    # peer has posted its receive. A stage output sent forward is waited on (and freed) when
    # its gradient comes back, so it lives exactly as long as its backward needs it.
    sending = 0.0
    for i, act in enumerate(actions):
        if i == cut:
            moments.append(sz.check_moment(sum(live.values()) + pending + sending))
        if act.kind in ("RECV_F", "RECV_B"):
            pending += recv
            continue
        if act.kind == "SEND_B":  # a fresh input gradient, held by the send (see above)
            sending += recv
            continue
        if act.kind not in ("F", "B", "I"):
            continue
        st, mb = act.stage, act.microbatch
        got_b = act.kind != "F" and sched.next_stage(st) is not None and \
            sched.stage_to_rank[sched.next_stage(st)] != rank
        got_f = act.kind == "F" and sched.prev_stage(st) is not None and \
            sched.stage_to_rank[sched.prev_stage(st)] != rank
        if got_f:  # the received input becomes the stage input (counted in stage_act)
            pending -= recv
        acc = sum(sz.grads_of(x) for x in had_b) if sz.zero < 2 else 0.0
        if act.kind == "F":
            live[st, mb] = sz.stage_act(st)
            if sz.stages[st][3]:  # the stage holding the head
                base = sum(live.values()) + pending + sending
                held = sz.snapshot if i < cut else 0.0
                acc += sz.grads_full if i < cut and sz.zero < 2 else 0.0
                moments.append(_loss_forward_moment(sz, st, mb, acc, base, held))
            continue
        base = sum(live.values()) + pending + sending
        in_flight = pending - (recv if got_b else 0.0) + sending
        moments += _backward_moments(sz, st, mb, live, st not in had_b, acc, base, in_flight)
        live.pop((st, mb), None)
        had_b.add(st)
        if got_b:
            pending -= recv
        if i == last_b:
            moments += _end_of_step(cfg, sz)
    return moments


def _end_of_step(cfg: Config, sz: RankSizes) -> list[Moment]:
    """Gradient synchronisation, grad norm and the optimizer step (`sz.snapshot`: post-
    validation's copy of the optimizer states, made just before the update)."""
    units, k, padded, states, pb = sz.units, sz.k, sz.padded, sz.states, sz.pb
    grads_full, e, snapshot = sz.grads_full, sz.e, sz.snapshot
    p, tr = cfg.parallel, cfg.train
    zero, n_dp = p.zero, p.dp
    out: list[Moment] = []
    sharded = p.tp > 1 or p.pp > 1  # parameters carry shard dims: the norm sums in fp64
    grads = grads_full if zero < 2 else 0.0
    # data parallel (zero 0, bucketed): every bucket's flat copy lives until finish
    if zero == 0 and n_dp > 1 and p.data_parallel == "bucketed":
        out.append(Moment("data-parallel buckets (end of backward)",
                          states(grads, comm=grads_full)))
    shard_comm = sum(k.values()) * pb if zero == 1 else 0.0  # stage 1's shards: comm
    if zero >= 1 and n_dp > 1 and p.pp == 1:  # the embedding's reduce-scatter, the last
        comm, chunks = sz.reduce_scatters_in_flight(
            ["embed", *(u.name for u in units[1:])], cfg.microbatches() - 1, extra=1)
        out.append(Moment("embedding reduce-scatter (end of backward)",
                          states(grads, comm=comm + chunks)))
    elif zero >= 1 and n_dp > 1:  # pp > 1: a stage's units, reduce-scattered in its last B
        u = max(units, key=lambda x: padded[x.name]).name
        comm = (2 * padded[u] + k[u]) * pb + (shard_comm if zero == 1 else 0.0)
        out.append(Moment("reduce-scatter (end of backward)", states(grads, comm=comm)))
    # global grad norm: a temporary per parameter (fp64 when anything is sharded)
    if zero >= 1:
        largest = max(min(u.largest, k[u.name]) for u in units)
        tmp = 16 * largest
    else:
        largest = max(u.largest for u in units)
        tmp = 16 * largest if sharded else (4 + (4 if e != FP32 else 0)) * largest
    mo = Moment("grad norm", states(grads, comm=shard_comm))
    mo.bytes["activations"] += tmp
    out.append(mo)
    # optimizer: foreach chunks of ~OPT_CHUNK elements. A chunk's fp32 gradient copies (bf16
    # only) live until the clipped copies (clipping on) replace them, and those until the
    # denominator is built: two fp32 temporaries per element at once, one for fp32 unclipped
    sizes = ([x for u in units for x in u.params] if zero == 0 else [k[u.name] for u in units])
    per_elem = FP32 * (1 if pb == FP32 and tr.grad_clip <= 0 else 2)
    chunk = biggest = 0
    for x in sizes:
        chunk += x
        if chunk >= OPT_CHUNK:
            biggest, chunk = max(biggest, chunk), 0
    biggest = max(biggest, chunk)
    out.append(Moment("optimizer step", states(grads, comm=shard_comm,
                                               opt_extra=per_elem * biggest + snapshot)))
    if zero in (1, 2) and pb != FP32:  # every unit's updated shard cast, gathers in flight
        out.append(Moment("parameter all-gather", states(
            grads, comm=shard_comm, opt_extra=sum(k.values()) * pb + snapshot)))
    return out


def not_covered(cfg: Config) -> str | None:
    """Why this model would give a wrong number for cfg's layout (None: it is covered).

    Covered and checked against the tracker (tests/test_predict_vs_measured.py): dp with
    ZeRO 0-3, tp (+SP), pp with F/B schedules, and tp x pp with them. Not covered: the
    deferred weight work of I/W-split schedules, ZeRO with pp (measured 12-22 % under
    and 7 % over the tracker at pp=2 when a rank was one unit; each stage's units, their
    accumulated gradients and ZeRO-3's gathers are not walked), ZeRO-3's units kept
    gathered through the step (`parallel.zero3_gather = "step"`), a sequence split over
    ranks (context parallel: its ring buffers, the fp32 partial outputs and scores of each
    block are not modelled), the MoE block and multi-head latent attention. The closed
    form (kernels='fused') and the host check (plait/plan/host_memory.py) price the last
    ZeRO ones."""
    p = cfg.parallel
    if cfg.train.precision == "fp64":
        return ("train.precision=fp64: the eager memory model prices fp32 and bf16 runs "
                "(their fp32 temporaries, masters and moments), not the float64 oracle's, "
                "whose tensors are each twice their fp32 size; predict the fp32 run (about "
                "half the float64 run's bytes) or use kernels='fused'")
    if cfg.parallel.async_tp:
        return ("parallel.async_tp=true: the eager memory model does not follow async tensor "
                "parallel's rings (each hop's received chunk and partial product; measured "
                "8 % over at dp2 ZeRO-3 tp2); predict with kernels='fused'")
    if cfg.model.mla:
        return ("model.attention=mla: the eager memory model follows the GQA block's "
                "tensors only (not the latents, their norms and the per-head K/V of "
                "multi-head latent attention); predict with kernels='fused'")
    if cfg.model.n_experts:
        return (f"model.n_experts={cfg.model.n_experts}: the eager memory model has no MoE "
                "block (router scores, dispatch order, per-expert activations); predict "
                "with kernels='fused' (the planner's GPU model)")
    for d in DIMENSIONS:  # a split sequence's attention
        if d.splits == "sequence" and getattr(p, d.name) > 1:
            return (f"{d.name}={getattr(p, d.name)}: the eager memory model does not follow "
                    f"{d.title}'s attention (ring K/V buffers, per-block scores); predict "
                    f"with kernels='fused', whose activations fall as 1/{d.name}")
    if p.zero == 3 and p.zero3_gather == "step":
        return ("parallel.zero3_gather=step: the eager memory model frees each ZeRO-3 unit "
                "after its use, not at the step's last backward; predict with "
                "zero3_gather=microbatch or kernels='fused'")
    if p.pp == 1:
        return None
    sched, _ = rank_stages(cfg, 0)
    if any(a.kind == "I" for acts in sched.actions for a in acts):
        from plait.schedule.registry import SCHEDULES

        whole_b = ", ".join(n for n, spec in SCHEDULES.items() if not spec.split_backward)
        return (f"schedule {p.schedule} splits backward into I and W; the eager memory model "
                "does not hold the outputs and gradients kept for W; predict with a F/B "
                f"schedule ({whole_b}) or kernels='fused'")
    if p.zero >= 1:
        return (f"zero={p.zero} with pp={p.pp}: the eager memory model does not follow "
                "ZeRO's units over the pipeline's stages; predict with zero=0 or "
                "kernels='fused'")
    return None


def _require_covered(cfg: Config) -> None:
    why = not_covered(cfg)
    if why is not None:
        raise ValueError(f"predict_memory(kernels='eager') does not cover this layout: {why}")


def eager_memory(cfg: Config, data_windows: int = 0) -> dict[str, float | str]:
    """Peak live bytes by category on the most loaded rank, as plait's CPU runtime holds
    them; also the moment ("moment") and pipeline rank ("rank") of the peak. A layout the
    model does not cover (`not_covered`) raises ValueError rather than give a wrong number."""
    _require_covered(cfg)
    best: Moment | None = None
    best_rank = 0
    for r in range(cfg.parallel.pp):
        for mo in rank_moments(cfg, r, data_windows):
            if best is None or mo.total > best.total:
                best, best_rank = mo, r
    assert best is not None
    out: dict[str, float | str] = {c: float(best.bytes.get(c, 0.0)) for c in CATEGORIES}
    out["total"] = best.total
    out["moment"] = best.name
    out["rank"] = best_rank
    return out


def eager_memory_by_rank(cfg: Config, data_windows: int = 0) -> list[dict[str, float | str]]:
    """The peak of each pipeline rank (categories, total, moment); ValueError when the
    layout is not covered (`not_covered`)."""
    _require_covered(cfg)
    rows = []
    for r in range(cfg.parallel.pp):
        mo = max(rank_moments(cfg, r, data_windows), key=lambda x: x.total)
        row: dict[str, float | str] = {c: float(mo.bytes.get(c, 0.0)) for c in CATEGORIES}
        row["total"], row["moment"], row["rank"] = mo.total, mo.name, r
        rows.append(row)
    return rows


def predicted_rank_memory(cfg: Config, pp_rank: int, data_windows: int
                          ) -> dict[str, float | str]:
    """The prediction `plait report` and the dry run print for pipeline rank `pp_rank` of
    a run whose loader permutes `data_windows` windows of its token file (the permutation
    is held through the run, so it is part of every peak): the rank's row of
    `eager_memory_by_rank`, or {"not_covered": why} (`not_covered`)."""
    why = not_covered(cfg)
    if why is not None:
        return {"not_covered": why}
    return eager_memory_by_rank(cfg, data_windows)[pp_rank]
