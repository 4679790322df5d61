"""Partition: the model's layers cut into pipeline stages, and the stage modules.

A *model stage* is a contiguous block of decoder layers; the first also holds the token
embedding, the last the final norm, LM head and loss. Blocks are balanced by cost (forward
FLOPs per token, the embedding and the head counted) with a min-max split; every stage gets
at least one layer, so a model with fewer layers than stages is refused with the options
that work (config validation: `registry.validate_schedule_request(..., n_layers=)`), and an
uneven split is deliberate and reported by `Partition.describe()`. How many stages a
schedule cuts the layers into is the registry's (`num_model_stages`).

`Stage` wraps slices of a built `Transformer` without editing model code: its parameters
keep the model's names (`layers.5.attn.wq.weight`), so name-seeded init gives every layout
the same weights and a gathered state compares with the reference by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.model.loss import token_loss
from plait.model.presets import ModelConfig
from plait.model.recompute import Recompute
from plait.model.transformer import Transformer, build_model, materialise, run_blocks
from plait.placement import PlacementTable
from plait.schedule.ir import Schedule
from plait.schedule.lower import lower
from plait.schedule.registry import (
    build_schedule,
    natural_virtual_stages,
    num_model_stages,
)

if TYPE_CHECKING:
    from plait.config import Config


def layer_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """(embedding, one decoder layer, head + loss) forward FLOPs per token."""
    h = cfg.dim
    matmul = 2 * (cfg.attention_matmul_params() + 3 * h * cfg.ffn_dim)
    attention = cfg.attention_core_flops(seq_len)  # scores + values, causal half, forward
    embed = float(h)  # a gather: counted, though small
    head = 2.0 * h * cfg.vocab_size + 4.0 * cfg.vocab_size  # matmul + softmax/CE
    return embed, float(matmul + attention), head


@dataclass(frozen=True)
class Partition:
    layers: tuple[tuple[int, int], ...]  # [start, end) of each model stage
    costs: tuple[float, ...]  # relative cost of each model stage

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    @property
    def even(self) -> bool:
        return len({e - s for s, e in self.layers}) == 1

    def describe(self) -> str:
        counts = [e - s for s, e in self.layers]
        top = max(self.costs)
        parts = [f"{c}" for c in counts]
        txt = (f"{sum(counts)} layers into {len(counts)} stages: {'+'.join(parts)} "
               f"(stage cost / max: {', '.join(f'{c / top:.2f}' for c in self.costs)}; "
               "embedding on the first, head + loss on the last)")
        return txt if self.even else txt + " - uneven on purpose, balanced by cost"


def partition_layers(n_layers: int, num_stages: int, embed: float = 0.0, layer: float = 1.0,
                     head: float = 0.0) -> Partition:
    """Contiguous split of n_layers into num_stages (each >= 1 layer): the most expensive
    stage as cheap as possible, then, among those splits, the most even (least sum of
    squared stage costs). Two small dynamic programmes over (stage, first layer)."""
    if num_stages < 1 or n_layers < num_stages:
        raise ValueError(f"cannot cut {n_layers} layers into {num_stages} stages of at least "
                         f"one layer; use at most {n_layers} stages")

    def cost(i: int, a: int, b: int) -> float:
        return (b - a) * layer + (embed if i == 0 else 0.0) + (
            head if i == num_stages - 1 else 0.0)

    def solve(score, combine, cap: float) -> tuple[float, tuple[int, ...]]:
        # best[i, a]: (score, stage ends) for stages i.. over layers a..n
        inf = (float("inf"), ())
        best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
        for i in range(num_stages - 1, -1, -1):
            for a in range(n_layers):
                if i == num_stages - 1:
                    c = cost(i, a, n_layers)
                    best[i, a] = (score(c), (n_layers,)) if c <= cap else inf
                    continue
                options = [inf]
                for b in range(a + 1, n_layers - (num_stages - i - 1) + 1):
                    c = cost(i, a, b)
                    rest, ends = best[i + 1, b]
                    if c <= cap and ends:
                        options.append((combine(score(c), rest), (b, *ends)))
                best[i, a] = min(options, key=lambda o: o[0])
        return best[0, 0]

    top, _ = solve(lambda c: c, max, float("inf"))
    _, ends = solve(lambda c: c * c, lambda x, y: x + y, top * (1 + 1e-12))
    bounds = tuple(zip((0, *ends[:-1]), ends, strict=True))
    return Partition(bounds, tuple(cost(i, a, b) for i, (a, b) in enumerate(bounds)))


def partition_for(cfg: ModelConfig, seq_len: int, num_stages: int) -> Partition:
    embed, layer, head = layer_costs(cfg, seq_len)
    return partition_layers(cfg.n_layers, num_stages, embed, layer, head)


class Stage(nn.Module):
    """One model stage: [embedding] -> layers[a:b] -> [norm -> head -> loss].

    forward(x) takes tokens on the first stage, hidden states otherwise; the last stage
    also takes the targets and returns the summed cross-entropy / tokens in the global
    batch (the quantity `microbatch_loss` returns; logits without targets), every other
    stage the hidden states.
    """

    def __init__(self, model: Transformer, layers: tuple[int, int], first: bool, last: bool):
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, first, last
        self.bounds = layers
        self.recompute = model.recompute
        self.loss_fn = None  # a split-logits loss (tensor parallel's vocab-parallel CE)
        # ways the hidden states between layers are split along the sequence (sequence
        # parallel sets it): what crosses a stage boundary is (batch, seq / seq_shards, dim)
        self.seq_shards = 1
        if first:
            self.embed = model.embed
        # a ModuleDict keyed by the model's layer index keeps the parameter names
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(*layers)})
        if last:
            self.norm, self.head = model.norm, model.head
        self.rope = model.rope  # the model's RoPE cache (no parameters)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                tokens_in_global_batch: int = 1, positions: torch.Tensor | None = None,
                aux_losses: list[torch.Tensor] | None = None,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`, `aux_losses` and `docs` as in `Transformer.hidden`."""
        # RoPE and the mask are over the full sequence, whatever crosses the boundary
        seq = x.shape[1] if self.first else x.shape[1] * self.seq_shards
        pos = self.rope(seq, x.device, positions, docs)
        if self.first:
            x = self.embed(x)
        x = run_blocks(self.layers.values(), x, pos, self.recompute, aux_losses)
        if not self.last:
            return x
        logits = self.head(self.norm(x))
        if targets is None:  # logits for a caller that computes its own loss
            return logits
        return token_loss(logits, targets, tokens_in_global_batch, self.loss_fn)

    def boundary_shape(self, batch: int, seq_len: int) -> tuple[int, int, int]:
        """The hidden states this stage receives or sends at a stage boundary."""
        return (batch, seq_len // self.seq_shards, self.cfg.dim)


class PipelineModule(nn.Module):
    """This rank's stages. Parameters keep the model's names inside each stage; DualPipe's
    second copies (chain 1) are held but not *owned*: the norm and `full_state` skip them."""

    def __init__(self, stages: dict[int, Stage], owned: list[int]):
        super().__init__()
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(stages.items())})
        self.owned = owned

    @property
    def model_names(self) -> dict[str, str]:
        """This module's parameter names -> the model's, for the owned stages."""
        return {f"stages.{s}.{n}": n for s in self.owned
                for n, _ in self.stages[str(s)].named_parameters()}

    def full_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for s in self.owned for n, p in self.stages[str(s)].named_parameters()]

    def owned_parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.full_named_parameters()]


@dataclass
class PipelineParts:
    model: nn.Module  # the Transformer when pp == 1, else a PipelineModule
    stages: dict[int, Stage]  # schedule stage id -> module, this rank's
    schedule: Schedule
    partition: Partition


def build_pipeline(cfg: Config, pp_rank: int, dtype: torch.dtype,
                   placements: PlacementTable | None = None, *,
                   model: Transformer | None = None,
                   device: torch.device | str = "cpu", fill: bool = True) -> PipelineParts:
    """Cut the model for cfg's schedule and materialise, on `device`, the stages rank
    `pp_rank` holds. `model`: the plain model built on the meta device (default: built
    here from cfg; its `recompute` flag then follows cfg.train.recompute). With pp == 1
    the one stage is the whole model and the schedule F, B per micro-batch. The stages'
    parameters are recorded in `placements` as distinct over pp. `fill=False`: allocated,
    not written (`materialise`; a dry run fills the slices it keeps)."""
    placements = PlacementTable() if placements is None else placements
    p, t = cfg.parallel, cfg.train
    m = cfg.microbatches()
    if model is None:
        model = build_model(cfg.model, seed=t.seed, device="meta")
        model.recompute = Recompute.of(t.recompute, t.recompute_ops)
    if p.pp == 1:
        model = materialise(model, cfg.model, t.seed, dtype, device, fill)
        n = cfg.model.n_layers
        part = Partition(((0, n),), (1.0,))
        return PipelineParts(model, {0: Stage(model, (0, n), True, True)},
                             build_schedule("1f1b", 1, m), part)
    v = natural_virtual_stages(p.schedule, p.virtual_stages)
    schedule = build_schedule(p.schedule, p.pp, m, v)
    if p.overlap_fb:  # the F&B pairs marked, for the runtime's overlapped executor
        schedule = lower(schedule, pair_fb=True)
    part = partition_for(cfg.model, t.seq_len, num_model_stages(p.schedule, p.pp, v))
    stages = {}
    for s in schedule.stages_on(pp_rank):
        j = schedule.model_stage(s)
        stage = Stage(model, part.layers[j], first=j == 0, last=j == part.num_stages - 1)
        stages[s] = materialise(stage, cfg.model, t.seed, dtype, device, fill)
        for q in stage.parameters():
            placements.mark_distinct(q, "pp")  # other layers on each pp rank
    owned = [s for s in stages if schedule.chain_of_stage(s) == 0]
    return PipelineParts(PipelineModule(stages, owned), stages, schedule, part)
