"""The planner's inputs and the sizes every formula derives from them: `Training` (the run),
`Layout` (one layout, or a batch of them as numpy arrays), `Basis` (the layout's sizes as
float arrays, built by estimate.py's `_basis`) and `ChunkTimes` (the durations of one
layer and one pipeline chunk). A module of their own so that estimate.py, which builds
them, and the communication model (plait/plan/comm/), which reads them, import one place
instead of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config import DEFAULT_ORDER
from plait.model.recompute_settings import DEFAULT_OPS
from plait.plan.compute import LayerTimes, Num


@dataclass
class Training:
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"
    optimizer: str = "adam"
    mem_limit_frac: float = 0.9  # of HBM usable: CUDA context, NCCL, fragmentation
    # parallel.optimizer_sync: "barrier" (every pipeline rank waits for the last before the
    # next step) or "post_validation" (the simulated pipeline time is the steady state)
    optimizer_sync: str = "barrier"


@dataclass
class Layout:
    """One layout; numeric fields may be numpy arrays (a batch of layouts)."""

    tp: Num = 1
    pp: Num = 1
    dp: Num = 1
    cp: Num = 1
    ep: Num = 1
    mbs: Num = 1  # sequences per micro-batch
    schedule: str = "1f1b"
    v: Num = 1  # virtual stages per rank (interleaved)
    zero: int = 1
    # none | selective | full (memory.layer_activations): nothing, the attention kernel's
    # probabilities (math) or plait's operator policy over `recompute_ops` (flash), all but
    # the layer input
    recompute: str = "none"
    sp: bool = True  # sequence parallelism with TP (Korthikanti et al. 2022)
    cp_mode: str = "ring"  # "ring" (Liu et al. 2023) | "allgather" K/V (Llama 3)
    # plait's own train.recompute when the layout is a plait config; it decides which
    # collectives the runtime replays (plait/plan/comm/layer.py). None: `recompute`, but
    # "none" for math's selective (only the attention core is redone, no collective)
    runtime_recompute: str | None = None
    attention: str = "flash"  # the kernel (shape.ATTENTION): what attention keeps, computes
    recompute_ops: tuple[str, ...] = DEFAULT_OPS  # selective with flash: groups recomputed
    # the mesh's order, innermost first (parallel.order): which groups stay inside a node.
    # The default keeps tp innermost; a custom order is modelled for dense layouts
    order: tuple[str, ...] = DEFAULT_ORDER

    def runtime_mode(self) -> str:
        if self.runtime_recompute is not None:
            return self.runtime_recompute
        if self.recompute == "selective" and self.attention == "math":
            return "none"
        return self.recompute

    def label(self) -> str:
        s = f"tp={self.tp},pp={self.pp},dp={self.dp}"
        if self.cp != 1:
            s += f",cp={self.cp}"
        if self.ep != 1:
            s += f",ep={self.ep}"
        if tuple(self.order) != DEFAULT_ORDER:  # innermost first (parallel.order)
            s += f" order {','.join(self.order)}"
        return s


@dataclass(frozen=True)
class Basis:
    """The layout's sizes as float arrays and what every later step derives from them."""

    tp: Num
    pp: Num
    dp: Num
    cp: Num
    ep: Num
    mbs: Num
    v: Num
    sched: str  # the layout's schedule; "1f1b" unless every layout has pp > 1
    e: int  # bytes per activation element
    peak_scale: float  # fp32 GEMMs against the bf16 peak (GPU.fp32_peak_ratio)
    # the GEMMs' rate against that peak: peak_scale, times the measured concurrent rate
    # where other ranks share the host (a measured profile's concurrent_gemm)
    gemm_scale: float
    m: Num  # micro-batches per step
    tokens: Num  # tokens of one micro-batch on one rank (the sequence split over cp)
    cpr: Num  # pipeline chunks per rank
    chunk_layers: Num
    rank_layers: Num
    saved: Num  # bytes one layer saves per micro-batch under the layout's recompute
    lt: LayerTimes  # forward times of one layer per micro-batch
    moe_split: Num  # ways an MoE block's tokens split over tp: tp under SP, else 1
    strides: dict[str, Num]  # rank distance between neighbours along each dim (the order)

    def span(self, dim: str) -> Num:
        """Ranks from the first to past the last of a `dim` group: inside one node when
        at most gpus_per_node (ranks are numbered node by node)."""
        return self.strides[dim] * getattr(self, dim)



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
