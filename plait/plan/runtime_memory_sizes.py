"""The sizes the runtime memory model (plait/plan/runtime_memory.py) is built from, per
pipeline rank.

From the configuration alone: the model's shapes per tensor-parallel rank, the stages a
pipeline rank holds, its ZeRO units and shards, model-state bytes by category, and what
one micro-batch keeps between its forward and backward (`RankSizes`, made once by
`rank_sizes`). runtime_memory.py walks the schedule with these to find the peak moment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plait.config import FIRST_BUCKET_MB, ZERO_REDUCE_SCATTERS_IN_FLIGHT
from plait.dims import REPLICA_AXES
from plait.parallel.buckets import backward_runs
from plait.plan.activations import (
    FP32,
    kv_width_per_rank,
    layer_activation_bytes,
    layer_saved_bytes,
    norm_bytes,
)
from plait.plan.basis import SHARD_COPIES
from plait.plan.memory import snapshot_bytes

if TYPE_CHECKING:
    from plait.config import Config

CATEGORIES = ("parameters", "gradients", "optimizer states", "activations", "logits",
              "communication buffers")


@dataclass
class Moment:
    """Live bytes by category at one moment of the step on one rank."""

    name: str
    bytes: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.bytes.values()))


@dataclass
class ZeroUnit:
    """One ZeRO unit (or one parameter group): local numel, its largest parameter."""

    name: str
    numel: int
    largest: int
    params: list[int]


# which of a block's parameters (the `layer` list of `_shapes`: norm, wq, wk, wv, wo, norm,
# w1, w3, w2) are Muon's matrices (plait/muon.py's rule)
MUON_LAYER_PARAMS = (1, 2, 3, 4, 6, 7, 8)


def _padded_vocab(v: int, t: int) -> int:
    return -(-v // t) * t


def _shapes(cfg: Config):
    m, p, t = cfg.model, cfg.parallel, cfg.parallel.tp
    h = m.dim
    k_t = kv_width_per_rank(m, t)
    v_t = _padded_vocab(m.vocab_size, t) // t if t > 1 else m.vocab_size
    layer = [h, h * h // t, h * k_t, h * k_t, h * h // t, h, h * m.ffn_dim // t,
             h * m.ffn_dim // t, h * m.ffn_dim // t]  # norm, wq, wk, wv, wo, norm, w1, w3, w2
    return {"h": h, "t": t, "sp": p.sp, "k_t": k_t, "v_t": v_t, "f_t": m.ffn_dim // t,
            "embed": [v_t * h], "layer": layer, "norm": [h],
            "head": [] if m.tie_embeddings and p.zero == 0 else [v_t * h]}


def rank_stages(cfg: Config, rank: int):
    """(schedule, {stage: (first layer, end layer, is_first, is_last)}) of pipeline rank."""
    from plait.parallel.pipeline.partition import partition_for
    from plait.schedule.registry import (
        build_schedule,
        natural_virtual_stages,
        num_model_stages,
    )

    p, n = cfg.parallel, cfg.model.n_layers
    m = cfg.microbatches()
    if p.pp == 1:
        return build_schedule("1f1b", 1, m), {0: (0, n, True, True)}
    v = natural_virtual_stages(p.schedule, p.virtual_stages)
    sched = build_schedule(p.schedule, p.pp, m, v)
    part = partition_for(cfg.model, cfg.train.seq_len, num_model_stages(p.schedule, p.pp, v))
    out = {}
    for s in sched.stages_on(rank):
        j = sched.model_stage(s)
        a, b = part.layers[j]
        out[s] = (a, b, j == 0, j == part.num_stages - 1)
    return sched, out


def _stage_params(sh: dict, a: int, z: int, first: bool, last: bool) -> list[tuple[str, list]]:
    """(name, parameter numels) of one stage's groups (pp = 1: embed, blocks, norm, head)."""
    out = []
    if first:
        out.append(("embed", sh["embed"]))
    out += [(f"layers.{i}", sh["layer"]) for i in range(a, z)]
    if last:
        out += [("norm", sh["norm"]), ("head", sh["head"])]
    return [(n, ps) for n, ps in out if ps]


def _rank_units(sh: dict, stages: dict, n_dp: int, cap_bytes: float | None, pb: int):
    """This rank's ZeRO units, their shard elements and their padded (to dp) elements.
    `cap_bytes` (ZeRO-1/2): consecutive groups of a stage share a unit up to about that
    many bytes, grouped in backward order and named by their first (plait/parallel/
    zero_units.py: a unit never spans two pipeline stages)."""
    units = []
    for st in sorted(stages):
        groups = _stage_params(sh, *stages[st])
        runs = [(r[0][0], [x for _, ps in r for x in ps]) for r in _runs(groups, cap_bytes, pb)]
        units += [ZeroUnit(name, sum(ps), max(ps), ps) for name, ps in runs]
    k = {u.name: -(-u.numel // n_dp) for u in units}  # shard elements per unit
    padded = {u.name: k[u.name] * n_dp for u in units}
    return units, k, padded


def _modules_after(z: int, j: int) -> list[str]:
    return [f"layers.{i}" for i in range(j + 1, z)] + ["norm", "head"]


def _runs(groups: list, cap_bytes: float | None, pb: int) -> list[list]:
    """`groups` in runs, each closed in backward order at `cap_bytes` (zero_unit_groups),
    in forward order."""
    if cap_bytes is None:
        return [[g] for g in groups]
    runs = backward_runs([sum(ps) * pb for _, ps in groups], cap_bytes)
    return [[groups[i] for i in reversed(run)] for run in reversed(runs)]


def _model_state_bytes(units: list[ZeroUnit], k: dict, padded: dict, zero: int, e: int,
                       pb: int) -> tuple[float, float, float, float]:
    """(parameters, optimizer states, full gradients, gradient shards) bytes of the rank."""
    n_params = sum(u.numel for u in units)
    if zero == 0:
        params = n_params * pb
        optim = n_params * (8 if e == FP32 else 12)  # fp32: the parameter is its own master
        grads_full = n_params * pb
        grad_shards = 0.0
    else:
        params = sum(k.values()) * pb if zero == 3 else sum(padded.values()) * pb
        optim = 12 * sum(k.values())  # fp32 master shard (a copy even in fp32), m, v
        grads_full = n_params * pb
        grad_shards = sum(k.values()) * pb
    return params, optim, grads_full, grad_shards


def _loss_transients(cfg: Config, e: int, tok: int, v_t: int, t: int) -> tuple[float, float]:
    """(forward, backward) loss transients on top of what the stage keeps (vocab-parallel:
    split over t)."""
    if t == 1:
        loss_fwd = e * tok * v_t + (FP32 * tok * v_t if e != FP32 else 0)  # logits (+ fp32)
        loss_bwd = 2 * FP32 * tok * v_t  # d(log-softmax) from nll, d(logits) in fp32
    else:
        padded_cols = _padded_vocab(cfg.model.vocab_size, t) != cfg.model.vocab_size
        loss_fwd = (e * tok * v_t + (FP32 * tok * v_t if e != FP32 else 0)
                    + (FP32 * tok * v_t if padded_cols else 0))
        loss_bwd = e * tok * v_t if e != FP32 else 0
    return loss_fwd, loss_bwd


@dataclass(frozen=True)
class RankSizes:
    """What every moment of one pipeline rank is built from, derived once from the config:
    shapes and element sizes, ZeRO units and shards, model-state bytes, what a (stage,
    micro-batch) keeps between its F and its B, and the loss / MLP-backward transients."""

    cfg: Config
    sh: dict  # _shapes(cfg)
    sched: Any  # the pipeline Schedule (pp = 1: one stage, F and B per micro-batch)
    stages: dict  # stage -> (first layer, end layer, is_first, is_last)
    e: int  # bytes per element of the compute dtype
    pb: int  # parameters and gradients are held in the compute dtype
    b: int  # micro-batch size
    s: int  # sequence length
    tok: int
    tok_l: int  # tokens of the residual stream on this rank
    n_micro: int
    recompute: bool
    units: list
    k: dict  # shard elements per unit
    padded: dict  # unit elements padded to a multiple of dp
    params: float
    optim: float
    grads_full: float
    grad_shards: float
    inputs: float  # this rank's int64 token rows, and the loader's epoch permutation
    layer_saved: float  # one block's saved tensors
    ckpt: float  # recompute: what each block keeps (full: its input; selective: + outputs)
    rope: float  # cos, sin tables (s, d/2) fp32, one pair per forward
    tp_ids: float  # int64 local ids + bool mask (embed / loss)
    loss_saved: float  # log-softmax (t=1) / softmax (vocab-parallel)
    loss_fwd: float
    loss_bwd: float
    mlp_bwd: float  # net d(out) + 2 f-wide buffers of a block's first MLP backward
    dy: float
    dprod: float
    recv: float  # a pipeline receive buffer: (mbs, seq[/t under SP], dim)
    w2: float  # w2's weight gradient
    layer_numel: int
    # post-validation: the optimizer state's copy, from the update until the next step's
    # check (plait/parallel/post_validation.py); 0 with the barrier
    snapshot: float = 0.0

    @property
    def zero(self) -> int:
        return self.cfg.parallel.zero

    def states(self, grads: float = 0.0, comm: float = 0.0, gathered: float = 0.0,
               opt_extra: float = 0.0, shards: float | None = None) -> dict[str, float]:
        """`shards`: ZeRO-2/3's gradient shards alive (None: every unit's)."""
        g = grads + ((self.grad_shards if shards is None else shards) if self.zero >= 2
                     else 0.0)
        return {"parameters": self.params + gathered, "gradients": g,
                "optimizer states": self.optim + opt_extra, "activations": self.inputs,
                "logits": 0.0, "communication buffers": comm}

    def shards_posted(self, mb: int, units: list[str]) -> float | None:
        """ZeRO-2/3's gradient shards alive in micro-batch `mb`: every unit's (None) from
        the second on; in the first, only those of `units`, whose reduce-scatter is posted
        (its output becomes the shard: the step starts with none, plait/parallel/zero.py)."""
        if self.zero < 2 or mb > 0:
            return None
        return sum(self.k[x] for x in units) * self.pb

    def reduce_scatters_in_flight(self, posted: list[str], mb: int, extra: int = 0
                                  ) -> tuple[float, float]:
        """(communication, gloo's chunks) bytes of ZeRO's reduce-scatters in micro-batch
        `mb` once the units `posted` (the last posted first) are: the last
        ZERO_REDUCE_SCATTERS_IN_FLIGHT of them (+ `extra` just posted, before the oldest is
        completed: plait/parallel/zero.py) hold their flat input, their output (ZeRO-2/3's
        first micro-batch's output is the shard, a gradient) and the direct
        reduce-scatter's all-to-all chunks; ZeRO-1's completed shards are communication."""
        flying = posted[:ZERO_REDUCE_SCATTERS_IN_FLIGHT + extra]
        first_shard = self.zero >= 2 and mb == 0
        comm = sum(self.padded[x] + (0 if first_shard else self.k[x]) for x in flying)
        if self.zero == 1:
            comm += sum(self.k[x] for x in posted[len(flying):])
        return comm * self.pb, sum(self.padded[x] for x in flying) * self.pb

    def posted_before(self, z: int, j: int) -> list[str]:
        """pp = 1 (blocks up to z): the units whose reduce-scatters backward posts before
        block j's, the last posted first (a unit is named by its first module)."""
        return [m for m in _modules_after(z, j) if m in self.k]

    def unit_grads_after(self, z: int, j: int) -> float:
        """ZeRO-2, pp = 1: the gradients of block j's unit's later modules while block j's
        backward runs, not yet reduce-scattered (posted once its first module's are done)."""
        if self.zero != 2:
            return 0.0
        sizes = {"norm": sum(self.sh["norm"]), "head": sum(self.sh["head"])}
        total = 0.0
        for m in _modules_after(z, j):
            if m in self.k:  # the next unit's first module: block j's unit ends before it
                break
            total += sizes.get(m, self.layer_numel)
        return total * self.pb

    def attn_norm_weight_grad(self) -> float:
        """A block's attention norm backward at its weight's gradient (the block's last):
        the norm still keeps its fp32 input and rsqrt; d(x) and d(x·rsqrt) are in flight."""
        h = self.sh["h"]
        return FP32 * self.tok_l * (h + 1) + 2 * self.e * self.tok * h

    def attn_norm_input_grad(self) -> float:
        """A block's attention norm backward after its weight's gradient (the block's last,
        whose reduce-scatter is then posted): the fp32 input it saved, d(input) through
        x·rsqrt, the mean's expanded gradient and the power rule's three fp32 temporaries
        (six fp32 (tokens, h) at its peak: the tracker's live tensors there, dp = 4, bf16),
        and the residual gradient waiting to be summed with it."""
        return (6 * FP32 + self.e) * self.tok_l * self.sh["h"]

    def first_bucket(self) -> tuple[float, int | None]:
        """Bucketed DP (pp = 1): (bytes, j) of its first bucket (FIRST_BUCKET_MB, in
        backward order: head, norm, the last block first), all-reduced during the last
        micro-batch's backward and held until the end of it by the blocks' backward
        moments below j; j None when there is nothing so early (one bucket, or no DP)."""
        p = self.cfg.parallel
        if self.zero or p.dp == 1 or p.pp > 1 or p.data_parallel != "bucketed":
            return 0.0, None
        cap = min(FIRST_BUCKET_MB, p.bucket_mb) * 2**20
        a, z = self.stages[0][:2]
        groups = [(z, self.sh["head"] + self.sh["norm"])]
        groups += [(j, self.sh["layer"]) for j in range(z - 1, a, -1)]  # block 0: the end
        size = 0.0
        for before, numels in groups:
            size += sum(numels) * self.pb
            if size >= cap:
                return size, before
        return 0.0, None

    def check_moment(self, activations: float) -> Moment:
        """Post-validation's check at the cut: the prefix's activations and transfers, the
        previous step's gradients and the optimizer states' copy, before it drops both."""
        mo = Moment("post-validation check (end of the prefix)",
                    self.states(self.grads_full if self.zero < 2 else 0.0,
                                opt_extra=self.snapshot))
        mo.bytes["activations"] += activations
        return mo

    def mlp_norm_backward(self, name: str, grads: float, first_b: bool, kept: float,
                          comm: float, gathered: float, shards: float | None = None) -> Moment:
        """A block's MLP norm backward, after w3's and w1's: `kept` (what the in-flight
        micro-batches and this block keep) less the MLP's saved tensors, plus the residual
        gradient, the region's entry gradient (the all-reduced copy under tp) and two fp32
        norm-backward temporaries; to `grads` it adds the MLP's three weight gradients and the
        norm's, new on the first backward (ZeRO-2/3: every one). Where tp-cut
        weight gradients are big beside a micro-batch's activations (8B at tp=8, sequence
        1024: 29 MiB each) this is the first backward's peak (found op by op with the
        tracker on that layout scaled down: tests/test_dry_run.py)."""
        fresh = (3 * self.w2 + self.sh["h"] * self.pb) if (self.zero >= 2 or first_b) else 0.0
        mo = Moment(name, self.states(grads + fresh, comm, gathered, shards=shards))
        h, tok_l = self.sh["h"], self.tok_l
        mlp_saved = 4 * self.e * self.tok * self.sh["f_t"]  # activations.py's mlp term
        mo.bytes["activations"] += (kept - mlp_saved + 2 * self.e * tok_l * h
                                    + 2 * FP32 * tok_l * h)
        return mo

    def stage_act(self, st: int, layers_kept: int | None = None) -> float:
        """Bytes (stage, micro-batch) holds after its F (layers_kept: only the first n)."""
        a, z, first, last = self.stages[st]
        e, h = self.e, self.sh["h"]
        n = z - a if layers_kept is None else layers_kept
        out = self.rope + n * (self.ckpt if self.recompute else self.layer_saved)
        if first:
            out += self.tp_ids
        if layers_kept is None and last:
            out += norm_bytes(self.cfg.model, self.b, self.s, self.sh["t"], self.sh["sp"],
                              e) + self.loss_saved
        if not last:
            out += e * self.tok_l * h  # the stage output, held for its backward
        if not first and e != FP32 and not self.recompute:
            out += e * self.tok_l * h  # the received input (fp32: it is the first norm's input)
        return out

    def grads_of(self, st: int) -> float:
        return sum(sum(ps) for _, ps in _stage_params(self.sh, *self.stages[st])) * self.pb


def rank_sizes(cfg: Config, rank: int, data_windows: int) -> RankSizes:
    """The sizes pipeline rank `rank`'s moments are built from (see RankSizes)."""
    m_cfg, p, tr = cfg.model, cfg.parallel, cfg.train
    sh = _shapes(cfg)
    h, t, sp, f_t, v_t = sh["h"], sh["t"], sh["sp"], sh["f_t"], sh["v_t"]
    e = FP32 if tr.precision == "fp32" else 2
    pb = e
    b, s = cfg.micro_batch_size(), tr.seq_len
    tok = b * s
    tok_l = tok // t if sp else tok
    sched, stages = rank_stages(cfg, rank)
    cap = p.bucket_mb * 2**20 if p.zero in (1, 2) else None
    units, k, padded = _rank_units(sh, stages, zero_ranks(cfg), cap, pb)
    params, optim, grads_full, grad_shards = _model_state_bytes(units, k, padded, p.zero, e,
                                                                pb)
    if tr.optimizer == "muon" and p.zero == 0 and not (cfg.model.n_experts or cfg.model.mla):
        # one fp32 momentum buffer a Muon matrix element, not AdamW's two moments
        layers = sum(stages[st][1] - stages[st][0] for st in stages)
        optim -= FP32 * layers * sum(sh["layer"][j] for j in MUON_LAYER_PARAMS)
    tp_ids = (8 * tok + tok) if t > 1 else 0
    loss_fwd, loss_bwd = _loss_transients(cfg, e, tok, v_t, t)
    # first MLP backward of a block: d(out) (whole sequence inside the region), then
    # d(product) (the product itself is freed once w2's gradient is done), d(silu out) and
    # d(w3 out): net d(out) + 2 f-wide buffers
    return RankSizes(
        cfg=cfg, sh=sh, sched=sched, stages=stages, e=e, pb=pb, b=b, s=s, tok=tok,
        tok_l=tok_l, n_micro=cfg.microbatches(), recompute=tr.recompute != "none",
        units=units, k=k, padded=padded, params=params, optim=optim, grads_full=grads_full,
        grad_shards=grad_shards,
        inputs=8 * (tr.global_batch // p.dp) * (s + 1) + 8 * data_windows,
        layer_saved=layer_activation_bytes(m_cfg, b, s, t, sp, e),
        ckpt=layer_saved_bytes(m_cfg, b, s, t, sp, e, tr.recompute, tr.recompute_ops),
        rope=FP32 * s * m_cfg.rope_dim, tp_ids=tp_ids, loss_saved=FP32 * tok * v_t + tp_ids,
        loss_fwd=loss_fwd, loss_bwd=loss_bwd, mlp_bwd=e * tok * h + 2 * e * tok * f_t,
        dy=e * tok * h, dprod=e * tok * f_t, recv=e * tok_l * h, w2=h * f_t * pb,
        layer_numel=sum(sh["layer"]), snapshot=_snapshot_bytes(cfg, units, k))


def zero_ranks(cfg: Config) -> int:
    """Ranks ZeRO shards a unit over, as the runtime does: the replica axes' ranks (data
    parallel's, times context parallel's: plait/mesh.py `replica_dim`), or with hybrid
    sharding one shard group of them (the copies hold the same shards)."""
    p = cfg.parallel
    return (math.prod(getattr(p, name) for name in REPLICA_AXES)
            // math.prod(getattr(p, name) for name in SHARD_COPIES))


def _snapshot_bytes(cfg: Config, units: list[ZeroUnit], k: dict) -> float:
    """The copy post-validation keeps of the optimizer's (ZeRO: shard of the) states."""
    if cfg.parallel.optimizer_sync != "post_validation":
        return 0.0
    numel = sum(u.numel for u in units) if cfg.parallel.zero == 0 else sum(k.values())
    return numel * snapshot_bytes("sgd" if cfg.train.optimizer == "sgd" else "adam")


def token_file_windows(cfg: Config) -> int:
    """seq_len windows of cfg.train.data (0 when it is not set or not readable): the count
    `plait.train.data.GlobalBatches` permutes each epoch."""
    from plait.train.data import DataError, TokenFile

    if not cfg.train.data:
        return 0
    try:
        return (len(TokenFile.open(cfg.train.data)) - 1) // cfg.train.seq_len
    except (OSError, DataError):
        return 0
