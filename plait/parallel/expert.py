"""Expert parallel: each rank of an `ep` group holds n_experts / ep of every MoE layer's
experts, and tokens travel to their experts and back by all-to-all (Lepikhin et al. 2020,
GShard; Stanford CS336, lecture 8 (parallelism)).

Where it lives: ep is laid over the replica axes (plait/dims/ep.py, `laid_ranks`). The
ranks of an ep group see different tokens and own different experts; the ranks of an
"edp" group own the same experts, so expert gradients are summed over edp, dense ones over
the replica axes as always (`reduce_dim`, read by the optimizers).

One MoE layer's forward on a rank of an ep group of size E, L = n / E local experts:

    tokens sorted by expert (the MoE block does that)
    1. counts:  all_to_all of the (E, L) assignment counts -> what each peer will send
    2. tokens:  all_to_all_single with uneven splits -> every token at its expert's rank,
                ordered by (source rank, local expert); regrouped expert-major
    3. experts: one grouped matmul per weight over the local experts
    4. back:    the reverse all-to-all, in the original order
Backward is the same all-to-alls reversed (`all_to_all_tokens`, plait/comm/autograd.py).
Experts are replicated over tp: without sequence parallel every tp rank routes the same
tokens (identical gradients, no tp reduction); with it each routes its own sequence chunk
and MoE gradients are summed over tp (the tensor-parallel plan's "sequence" style), counts
too for the balance loss.

After each step `finish_moe_step` sums every MoE layer's routing statistics over the
ranks that saw different tokens, updates the auxiliary-loss-free bias (DeepSeek-V3,
section 2.1.2: b_i += gamma * sign(mean load - load_i)) and returns the step's metrics.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from plait.comm import ops
from plait.comm.autograd import OverlapSeam, all_to_all_tokens
from plait.config import Config
from plait.dims import AXES, REPLICAS
from plait.mesh import ParallelMesh
from plait.model.moe import Experts, MoE
from plait.placement import PlacementTable, Split

DIM = "ep"


def reduce_dim(placements: PlacementTable, p: torch.Tensor, dense_dim: str) -> str:
    """Where `p`'s gradient is summed over data-parallel ranks: "edp" for an expert-parallel
    slice, `dense_dim` (dp, or dp_cp under context parallel) for everything else."""
    return "edp" if placements.of(p).split_on(DIM) is not None else dense_dim


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Row order that regroups rows laid out (source, expert)-major, `counts[source,
    expert]` rows each, into expert-major order (sources in order within an expert)."""
    flat = counts.reshape(-1)
    starts = (flat.cumsum(0) - flat).view_as(counts)
    lengths, first = counts.t().reshape(-1), starts.t().reshape(-1)
    seg_start = lengths.cumsum(0) - lengths
    total = int(lengths.sum())
    within = torch.arange(total, device=counts.device) - seg_start.repeat_interleave(lengths)
    return first.repeat_interleave(lengths) + within


class AllToAllDispatch:
    """The MoE block's `dispatch` under expert parallel (its contract: `local_experts` in
    plait/model/moe.py): token rows to the ranks owning their experts, the experts, the
    gated outputs back.

    `dedup=False` ("assignment"): one row per assignment, k a token; gates are applied at
    the source. `dedup=True` ("token"): one row per (token, destination rank): a token
    whose experts share a rank travels once (with node-limited routing, fewer ranks and
    nodes a token); the destination applies the gates (sent beside the rows) and sums a
    token's outputs before sending one row back."""

    def __init__(self, mesh: ParallelMesh, layer: str, dedup: bool = False):
        self.mesh, self.tag, self.dedup = mesh, f"ep.{layer}", dedup
        self.size = mesh.size(DIM)
        # the token all-to-alls' waits, taken over inside an overlapped F&B pair
        self.seam = OverlapSeam()

    def _exchange_counts(self, send: torch.Tensor) -> torch.Tensor:
        # pre-filled with what this rank sends: a real all-to-all overwrites it; under a dry
        # run's fake process group (plait/observe/dry_run.py) it stays, a symmetric load
        recv = send.clone()
        ops.all_to_all(recv, send.contiguous(), self.mesh, DIM, tag=self.tag + ".counts")
        return recv

    def __call__(self, flat: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                 counts: torch.Tensor, experts: Experts, k: int) -> torch.Tensor:
        if self.dedup:
            return self._by_token(flat, slots, gates, counts, experts, k)
        recv = self._exchange_counts(counts.view(self.size, -1))  # (peer, its experts)
        in_splits, out_splits = counts.view(self.size, -1).sum(1).tolist(), \
            recv.sum(1).tolist()
        arrived = all_to_all_tokens(flat[slots // k], self.mesh, out_splits, in_splits,
                                    self.tag, DIM, self.seam)
        order = expert_major(recv)
        y = experts(arrived[order], recv.sum(0))
        back = torch.empty_like(y).index_copy(0, order, y)  # (source, expert)-major again
        y = all_to_all_tokens(back, self.mesh, in_splits, out_splits, self.tag, DIM, self.seam)
        weighted = y * gates[slots].unsqueeze(-1).to(y.dtype)
        combined = weighted.new_zeros(flat.shape[0] * k, flat.shape[1]).index_copy(
            0, slots, weighted)
        return combined.view(-1, k, flat.shape[1]).sum(1)

    def _by_token(self, flat: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                  counts: torch.Tensor, experts: Experts, k: int) -> torch.Tensor:
        t, local = flat.shape[0], counts.numel() // self.size
        token = slots // k
        dest = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device),
                                       counts) // local
        # unique (destination, token) rows, in that order; each assignment's row within
        # its destination's block
        uniq, which = torch.unique(dest * t + token, sorted=True, return_inverse=True)
        send_rows = torch.bincount(uniq // t, minlength=self.size)
        row_in_block = which - (send_rows.cumsum(0) - send_rows)[dest]
        recv = self._exchange_counts(torch.cat([counts.view(self.size, -1),
                                                send_rows.view(-1, 1)], 1))
        per_expert, recv_rows = recv[:, :local], recv[:, local]
        a_in, a_out = counts.view(self.size, -1).sum(1).tolist(), per_expert.sum(1).tolist()
        u_in, u_out = send_rows.tolist(), recv_rows.tolist()
        rows = all_to_all_tokens(flat[uniq % t], self.mesh, u_out, u_in, self.tag, DIM)
        where = row_in_block.new_empty(sum(a_out))
        ops.all_to_all(where, row_in_block, self.mesh, DIM, a_out, a_in,
                       tag=self.tag + ".rows")
        g = all_to_all_tokens(gates[slots], self.mesh, a_out, a_in, self.tag + ".gates", DIM)
        source = torch.repeat_interleave(torch.arange(self.size, device=counts.device),
                                         per_expert.sum(1))
        row = (recv_rows.cumsum(0) - recv_rows)[source] + where  # into `rows`
        order = expert_major(per_expert)
        y = experts(rows[row[order]], per_expert.sum(0))
        y = torch.empty_like(y).index_copy(0, order, y) * g.unsqueeze(-1).to(y.dtype)
        summed = y.new_zeros(rows.shape).index_add(0, row, y)  # one row per token here
        back = all_to_all_tokens(summed, self.mesh, u_in, u_out, self.tag, DIM)
        return back.new_zeros(flat.shape).index_add(0, uniq % t, back)


def moe_layers(stages: Iterable[nn.Module]) -> list[tuple[str, MoE]]:
    """(name, module) of every MoE block in `stages`, in order."""
    return [(name, m) for stage in stages for name, m in stage.named_modules()
            if isinstance(m, MoE)]


def balance_biases(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(model name, tensor, owned) of every MoE block's balancing bias this rank holds, its
    stages in order: training state beside the parameters (fp32, whole on every rank of
    its stage, updated by `finish_moe_step`), saved by checkpoints as its `master`.
    `model`: the Transformer (pp = 1) or this rank's PipelineModule; `owned` is False on
    DualPipe's second copies."""
    stages = model.stages.items() if hasattr(model, "stages") else [("0", model)]
    owned = getattr(model, "owned", None)
    return [(f"{name}.bias", m.bias, owned is None or int(s) in owned)
            for s, stage in stages for name, m in moe_layers([stage])]


def apply_expert_parallel(stages: Iterable[nn.Module], mesh: ParallelMesh,
                          placements: PlacementTable, dispatch: str = "assignment") -> None:
    """Keep this ep rank's experts of every MoE block (rows [r L, (r+1) L) of each stacked
    weight, recorded as an "ep" split along axis 0) and give the block the all-to-all
    (`dispatch`: "assignment" or "token", see AllToAllDispatch)."""
    size, r = mesh.size(DIM), mesh.coord(DIM)
    for name, moe in moe_layers(stages):
        ex = moe.experts
        local = ex.w1.shape[0] // size
        for pname in ("w1", "w2", "w3"):
            full = getattr(ex, pname)
            part = nn.Parameter(full.detach()[r * local:(r + 1) * local].clone())
            placements.mark_split(part, full, Split(DIM, 0, full.shape[0]), mesh)
            setattr(ex, pname, part)
        moe.dispatch = AllToAllDispatch(mesh, name, dedup=dispatch == "token")


def gather_expert_state(model: nn.Module, mesh: ParallelMesh, placements: PlacementTable,
                        state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (this rank's tensors by `model`'s names) with every expert slice all-gathered
    over ep into the full stacked weight. Collective over ep."""
    out = dict(state)
    size = mesh.size(DIM)
    for name, p in model.named_parameters():
        if size == 1 or placements.of(p).split_on(DIM) is None or name not in state:
            continue
        local = state[name].contiguous()
        full = local.new_empty((size * local.shape[0], *local.shape[1:]))
        ops.all_gather(full, local, mesh, DIM, tag="state")
        out[name] = full
    return out


def token_groups(mesh: ParallelMesh, sp: bool) -> list[str]:
    """Dims over which ranks see different tokens (their routing statistics add up)."""
    return [REPLICAS, *(["tp"] if sp else [])]


def sequence_counts_over(mesh: ParallelMesh, dims: list[str]):
    """The MoE block's `sequence_counts` when a sequence is split over `dims` (context
    parallel, or tp under sequence parallel): each sequence's expert counts summed over them."""
    def total(counts: torch.Tensor) -> torch.Tensor:
        out = counts.clone()
        for d in dims:
            ops.all_reduce(out, mesh, d, tag="moe.counts")
        return out
    return total


def finish_moe_step(stages: Iterable[nn.Module], mesh: ParallelMesh, sp: bool,
                    update_bias: bool) -> dict:
    """After a step's backward: each MoE layer's load summed over the token groups, the
    bias updated (`update_bias`: the step was applied), the statistics reset. Returns the
    step's metrics: balance loss, max / mean expert load (worst layer), dropped tokens."""
    layers = moe_layers(stages)  # may be none here (a dense stage) but some elsewhere
    dev = mesh.device.torch
    loads = torch.stack([m.load.to(dev) for _, m in layers]) if layers else torch.ones(
        (1, 1), dtype=torch.float64, device=dev)
    extra = torch.tensor([sum(m.aux_sum for _, m in layers),
                          sum(m.dropped for _, m in layers)], dtype=torch.float64, device=dev)
    for d in token_groups(mesh, sp):
        ops.all_reduce(loads, mesh, d, tag="moe.load")
        ops.all_reduce(extra, mesh, d, tag="moe.load")
    for (_, m), load in zip(layers, loads[:len(layers)], strict=True):  # a dense stage: none
        rate = m.bias_rate
        if update_bias and rate > 0:
            with torch.no_grad():
                step = torch.sign(load.mean() - load).to(m.bias.dtype)
                m.bias.add_(rate * step)
        m.reset_stats()
    # the metrics row is every rank's: other stages hold other layers
    imbalance = (loads.max(1).values / loads.mean(1).clamp_min(1e-12)).max().reshape(1)
    ops.all_reduce(extra, mesh, "pp", tag="metrics")
    ops.all_reduce(imbalance, mesh, "pp", op="max", tag="metrics")
    return {"moe": {"aux_loss": float(extra[0]), "load_max_over_mean": float(imbalance),
                    "dropped_tokens": int(extra[1])}}


def prepare_moe_blocks(stages: Iterable[nn.Module], mesh: ParallelMesh, cfg: Config,
                       placements: PlacementTable) -> None:
    """Every MoE block of this rank's stages: the balance loss scaled like the token loss;
    where a sequence is split over ranks (the sequence-splitting dimensions, and tp under
    sequence parallel) its routing counts summed over them; with ep > 1 only this rank's
    experts kept, tokens dispatched by all-to-all."""
    p, t = cfg.parallel, cfg.train
    split = [d.name for d in AXES if d.splits == "sequence" and mesh.size(d.name) > 1]
    split += ["tp"] if p.sp and p.tp > 1 else []
    stages = list(stages)
    for _, moe in moe_layers(stages):
        moe.aux_loss_scale = 1.0 / (t.global_batch * t.seq_len)
        if split:
            moe.sequence_counts = sequence_counts_over(mesh, split)
    if mesh.size(DIM) > 1:
        apply_expert_parallel(stages, mesh, placements, p.ep_dispatch)

