"""The planner's inputs and the sizes every formula derives from them: `Training` (the run),
`Layout` (one layout, or a batch of them as numpy arrays), `Basis` (the layout's sizes as
float arrays and what every later step derives from them, `basis_of`) and `ChunkTimes`
(the durations of one layer and one pipeline chunk). A module of their own so that
estimate.py, which builds them, and the communication model (plait/plan/comm/), which
reads them, import one place instead of each other.

A layout's sizes are the dimension records' (plait/dims/): `sizes` by record name, each
also an attribute (`lay.tp`), and the quantities the formulas mean, read from what the
records say each dimension splits: `replicas` (the ranks holding copies of the
parameters: gradients are summed over them), `seq_split` (the ranks one sequence is split
over), `expert_split` (the ranks the routed experts are split over), `shard_copies` (the
copies of each ZeRO shard: hybrid sharding's replica groups) and `zero_split` (the ranks
ZeRO shards a parameter's states over: replicas / shard_copies) and `world`. The planner's
formulas name those, not the dimensions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from plait.dims import AXES, BY_NAME, DEFAULT_ORDER, DIMENSIONS, LAID, REPLICA_AXES
from plait.model.recompute_settings import DEFAULT_OPS
from plait.plan import bubble, fp8, host_share, memory, memory_bound
from plait.plan.comm import price
from plait.plan.compute import Efficiency, LayerTimes, Num, layer_times
from plait.plan.hardware import Cluster
from plait.plan.shape import Shape
from plait.plan.stack import Stack, stage_layers

# How the planner writes a layout (labels, `--layout`, the JSON's "layout"): these sizes
# always, in this order, then every other dimension's in the records' order (a label
# names those only where they are not 1)
ALWAYS_WRITTEN = ("tp", "pp", "dp")
WRITTEN = ALWAYS_WRITTEN + tuple(d.name for d in DIMENSIONS if d.name not in ALWAYS_WRITTEN)
SEQUENCE_SPLIT = tuple(d.name for d in DIMENSIONS if d.splits == "sequence")
EXPERT_SPLIT = tuple(d.name for d in DIMENSIONS if d.splits == "experts")
# laid over the replicas and splitting the batch: groups of replicas that hold copies of
# each other's ZeRO shards (hybrid sharding)
SHARD_COPIES = tuple(d.name for d in LAID if d.splits == "batch")


def product(sizes: Mapping[str, Num], names: Iterable[str]) -> Num:
    """The product of `sizes` over `names`, in that order (1 for none)."""
    out: Num = 1
    for name in names:
        out = out * sizes[name]
    return out


class Sizes:
    """A layout's dimension sizes (`sizes`, by record name) and what they mean."""

    sizes: dict[str, Num]

    @property
    def world(self) -> Num:
        """Ranks in all: the product of the rank grid's axes."""
        return product(self.sizes, (d.name for d in AXES))

    @property
    def replicas(self) -> Num:
        """Ranks holding whole copies of the parameters (the records that replicate them):
        their gradients are summed over these, ZeRO shards over them, and a laid
        dimension (expert parallel) cuts its groups from them."""
        return product(self.sizes, REPLICA_AXES)

    @property
    def seq_split(self) -> Num:
        """Ranks one sequence is split over: each holds tokens / seq_split of it."""
        return product(self.sizes, SEQUENCE_SPLIT)

    @property
    def expert_split(self) -> Num:
        """Ranks an MoE layer's routed experts are split over."""
        return product(self.sizes, EXPERT_SPLIT)

    @property
    def shard_copies(self) -> Num:
        """Copies of each ZeRO shard (hybrid sharding's replica groups; 1 without): ZeRO
        shards inside groups of `zero_split` replicas, and the copies all-reduce the
        reduced gradient shards."""
        return product(self.sizes, SHARD_COPIES)

    @property
    def zero_split(self) -> Num:
        """Ranks ZeRO shards a parameter's states over (its dense ones; routed experts'
        over zero_split / expert_split): the replicas, or one shard group of them."""
        return self.replicas / self.shard_copies

    def laid(self) -> dict[str, Num]:
        """The sizes of the dimensions laid over the replicas, not axes of the grid."""
        return {d.name: self.sizes[d.name] for d in LAID}


def _size_of(name: str) -> property:
    return property(lambda self: self.sizes[name], doc=f"the {BY_NAME[name].title} size")


for _d in DIMENSIONS:  # lay.tp, b.pp, ...: each record's size by its name
    setattr(Sizes, _d.name, _size_of(_d.name))


@dataclass
class Training:
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"
    optimizer: str = "adam"
    mem_limit_frac: float = 0.9  # of HBM usable: CUDA context, NCCL, fragmentation
    # parallel.optimizer_sync: "barrier" (every pipeline rank waits for the last before the
    # next step) or "post_validation" (the simulated pipeline time is the steady state)
    optimizer_sync: str = "barrier"
    # how the stack runs it: overlaps, uneven pipeline stages (plait/plan/stack.py)
    stack: Stack = field(default_factory=Stack)
    # float8's blockwise recipe: its tile B (train.fp8_block); 0: tensorwise or no float8
    fp8_block: int = 0


@dataclass(init=False)
class Layout(Sizes):
    """One layout; numeric fields may be numpy arrays (a batch of layouts). The sizes are
    given by record name, `Layout(tp=8, pp=2, dp=4)` (1 for a dimension not given), or
    as a mapping, `Layout({"tp": 8}, ...)`."""

    sizes: dict[str, Num]  # every dimension's size, by record name
    mbs: Num  # sequences per micro-batch
    schedule: str
    v: Num  # virtual stages per rank (interleaved)
    zero: int
    # none | selective | full (memory.layer_activations): nothing, the attention kernel's
    # probabilities (math) or plait's operator policy over `recompute_ops` (flash), all but
    # the layer input
    recompute: str
    sp: bool  # sequence parallelism with TP (Korthikanti et al. 2022)
    # SP's collectives as ring hops overlapped with their matmuls (plait/plan/comm/async_tp.py)
    async_tp: bool
    # context parallel's K/V: "ring" (Liu et al. 2023) | "allgather" (Llama 3) | "a2a"
    # (Ulysses) | "hierarchical" (all-to-all in groups of cp_a2a ranks, ring across them)
    cp_mode: str
    cp_a2a: int
    # plait's own train.recompute when the layout is a plait config; it decides which
    # collectives the runtime replays (plait/plan/comm/layer.py). None: `recompute`, but
    # "none" for math's selective (only the attention core is redone, no collective)
    runtime_recompute: str | None
    attention: str  # the kernel (shape.ATTENTION): what attention keeps, computes
    recompute_ops: tuple[str, ...]  # selective with flash: groups recomputed
    # the mesh's order, innermost first (parallel.order): which groups stay inside a node.
    # The default keeps tp innermost; a custom order is modelled for dense layouts
    order: tuple[str, ...]
    zero3_gather: str  # parallel.zero3_gather: "microbatch" | "step" (comm/step.py)
    # DualPipe's F&B pairs run overlapped (plait train's parallel.overlap_fb): only then
    # are a pair's expert all-to-alls priced as hidden (comm/layer.py)
    overlap_fb: bool

    def __init__(self, sizes: Mapping[str, Num] | None = None, mbs: Num = 1,
                 schedule: str = "1f1b", v: Num = 1, zero: int = 1, recompute: str = "none",
                 sp: bool = True, cp_mode: str = "ring", runtime_recompute: str | None = None,
                 attention: str = "flash", recompute_ops: tuple[str, ...] = DEFAULT_OPS,
                 order: tuple[str, ...] = DEFAULT_ORDER, zero3_gather: str = "microbatch",
                 cp_a2a: int = 1, async_tp: bool = False, overlap_fb: bool = False,
                 **by_name: Num) -> None:
        unknown = sorted(set(sizes or {}) - set(BY_NAME)) + sorted(set(by_name) - set(BY_NAME))
        if unknown:
            raise TypeError(f"Layout: no dimension {', '.join(unknown)}; the dimensions are "
                            f"{', '.join(BY_NAME)}")
        self.sizes = {d.name: (sizes or {}).get(d.name, by_name.get(d.name, 1))
                      for d in DIMENSIONS}
        self.mbs, self.schedule, self.v, self.zero = mbs, schedule, v, zero
        self.recompute, self.sp, self.cp_mode = recompute, sp, cp_mode
        self.cp_a2a = cp_a2a
        self.runtime_recompute, self.attention = runtime_recompute, attention
        self.recompute_ops, self.order = recompute_ops, order
        self.zero3_gather, self.async_tp, self.overlap_fb = zero3_gather, async_tp, overlap_fb

    def runtime_mode(self) -> str:
        if self.runtime_recompute is not None:
            return self.runtime_recompute
        if self.recompute == "selective" and self.attention == "math":
            return "none"
        return self.recompute

    def label(self) -> str:
        s = ",".join(f"{name}={self.sizes[name]}" for name in ALWAYS_WRITTEN)
        s += "".join(f",{name}={self.sizes[name]}" for name in WRITTEN[len(ALWAYS_WRITTEN):]
                     if self.sizes[name] != 1)
        if tuple(self.order) != DEFAULT_ORDER:  # innermost first (parallel.order)
            s += f" order {','.join(self.order)}"
        return s


@dataclass(frozen=True)
class Basis(Sizes):
    """The layout's sizes as float arrays and what every later step derives from them
    (`basis_of`)."""

    sizes: dict[str, Num]  # every dimension's size, by record name
    mbs: Num
    v: Num
    sched: str  # the layout's schedule; "1f1b" unless every layout has pp > 1
    e: int  # bytes per activation element
    peak_scale: float  # fp32 GEMMs against the bf16 peak (GPU.fp32_peak_ratio)
    # the GEMMs' rate against that peak: peak_scale, times the measured concurrent rate
    # where other ranks share the host (a measured profile's concurrent_gemm)
    gemm_scale: float
    m: Num  # micro-batches per step
    tokens: Num  # tokens of one micro-batch on one rank (the sequence split: seq_split)
    cpr: Num  # pipeline chunks per rank
    chunk_layers: Num
    rank_layers: Num
    saved: Num  # bytes one layer saves per micro-batch under the layout's recompute
    lt: LayerTimes  # forward times of one layer per micro-batch
    moe_split: Num  # ways an MoE block's tokens split over tp: tp under SP, else 1
    strides: dict[str, Num]  # rank distance between neighbours along each axis (the order)
    # layers of the first and the last pipeline stage (uneven stages: Training.stack; else
    # chunk_layers)
    first_layers: Num = 0.0
    last_layers: Num = 0.0
    fused_kernels: bool = True  # the stack's (Training.stack): eager counts each operator

    def span(self, dim: str) -> Num:
        """Ranks from the first to past the last of a `dim` group: inside one node when
        at most gpus_per_node (ranks are numbered node by node)."""
        return self.strides[dim] * self.sizes[dim]


def _f(x: Num) -> Num:
    return np.asarray(x, dtype=float)


def basis_of(shape: Shape, cluster: Cluster, train: Training, lay: Layout,
             eff: Efficiency) -> Basis:
    """The basis every formula of `evaluate` (plait/plan/estimate.py) reads for `lay`."""
    sizes = {name: _f(size) for name, size in lay.sizes.items()}
    tp, pp, dp, mbs, v = sizes["tp"], sizes["pp"], sizes["dp"], _f(lay.mbs), _f(lay.v)
    seq_split = product(sizes, SEQUENCE_SPLIT)
    sched = lay.schedule if np.all(pp > 1) else "1f1b"
    e = memory.PRECISIONS[train.precision][3]
    peak_scale = cluster.gpu.fp32_peak_ratio if train.precision == "fp32" else 1.0
    shared_host = host_share.host_ranks(cluster) > 1
    gemm_scale = peak_scale * (eff.concurrent_gemm if shared_host else 1.0)
    tokens = mbs * shape.seq / seq_split
    cpr = _f(bubble.chunks_per_rank(sched, v))
    even = np.ceil(shape.layers / _f(bubble.stages_per_chain(sched, pp, v)))
    first, middle, last = stage_layers(shape.layers, pp, even, train.stack)
    chunk_layers = np.maximum(np.maximum(first, middle), last)  # the slowest stage's
    saved_none = memory.layer_activations(shape, mbs, tp, seq_split, lay.sp, "none", e,
                                          lay.attention)
    lt = layer_times(shape, tokens, tp, cluster.gpu, eff, saved_none, gemm_scale,
                     tp if lay.sp else 1.0, lay.attention,
                     fp8.weight_gemms(train.precision, cluster.gpu, eff, gemm_scale))
    if memory_bound.priced(eff):  # the published GPU numbers: each kernel's bytes
        casts = (fp8.cast_kernel(shape, tokens, tp, e, lay.zero, bool(train.fp8_block)),) \
            if fp8.is_fp8(train.precision) else ()
        lt = memory_bound.with_memory_bound(lt, shape, tokens, tp, lay.sp, e, lay.attention,
                                            tp if lay.sp else 1.0, cluster.gpu, eff,
                                            train.stack.fused_kernels, casts)
    return Basis(
        sizes=sizes, mbs=mbs, v=v, sched=sched, e=e,
        peak_scale=peak_scale, gemm_scale=gemm_scale, m=train.global_batch / (dp * mbs),
        tokens=tokens, cpr=cpr,
        chunk_layers=chunk_layers, rank_layers=chunk_layers * cpr,
        saved=memory.layer_activations(shape, mbs, tp, seq_split, lay.sp, lay.recompute, e,
                                       lay.attention, lay.recompute_ops),
        lt=lt, moe_split=tp if lay.sp else 1.0,
        strides=price.order_strides(lay.order, sizes), first_layers=first * cpr,
        last_layers=last * cpr, fused_kernels=train.stack.fused_kernels)


@dataclass
class ChunkTimes:
    """Durations of one layer's F, I (input gradient), W (weight gradient), of the LM head,
    and of one pipeline chunk (chunk_layers layers)."""

    f_layer: Num
    i_layer: Num
    w_layer: Num
    hf: Num  # the head's FLOPs
    head_g: Num  # the head's GEMM time
    head_f: Num  # the head's forward: GEMM plus writing the logits
    f_c: Num
    i_c: Num
    w_c: Num
    policy: Num = 0.0  # per layer: selective's policy (Efficiency.policy_layer_seconds)
    tp_cpu: Num = 0.0  # per layer: a tp rank's CPU beyond the prices (tp_floor_seconds)
    # in head_f: the final norm's and the loss's memory-bound kernels (published GPU
    # numbers: plait/plan/memory_bound.py; 0 otherwise)
    head_mb: Num = 0.0


__all__ = ["ALWAYS_WRITTEN", "SHARD_COPIES", "WRITTEN", "Basis", "ChunkTimes", "Layout",
           "Sizes", "Training", "basis_of", "product"]
