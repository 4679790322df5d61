"""Mixture-of-experts MLP: a router sends each token to k of n SwiGLU experts.

    scores  = softmax(x W_r) | sigmoid(x W_r)        (router in fp32, whatever the dtype)
    chosen  = top-k of (scores + bias)                (bias: selection only, never gates)
    gates   = scores of the chosen (/ their sum when normalised) x routed_scale
    y       = sum_j gate_j * expert_{chosen_j}(x)  (+ shared experts(x))

Sources: Shazeer et al. 2017 (sparsely-gated MoE); Lepikhin et al. 2020 (GShard: top-2,
expert capacity, dropping); Fedus et al. 2022 (Switch Transformer, eq. 4: the balance loss
alpha * N * sum_i f_i P_i); Jiang et al. 2024 (Mixtral: softmax over the top-k); DeepSeek-AI
2024 (DeepSeek-V3 technical report, section 2.1.2: sigmoid affinities normalised over the
selected, shared experts, auxiliary-loss-free balancing b_i += gamma * sign(mean load -
load_i), node-limited routing, the complementary sequence-wise balance loss, eqs. 17-20).

Layout independence, which the parity tests rely on:
  * routing ties are broken by the lowest expert index (a stable sort), never by kernel order;
  * the balance loss is sequence-wise (DeepSeek-V3 eq. 17-20): f and P are per sequence,
    so it is the same however the batch is split; written as a sum over tokens given the
    sequence's (non-differentiable) f, it sums exactly over the ranks that hold parts of a
    sequence (`sequence_counts` adds their counts: sequence/context parallel);
  * capacity (when `capacity_factor` is set) is per sequence and per expert, C = ceil(cf * S *
    k / n); a sequence's assignments past C are dropped in token order. It needs whole
    sequences on the rank (config validation refuses it with sequence or context parallel).
Parallelism plugs into two seams, set from outside: `dispatch` (expert parallel replaces it
by an all-to-all, plait/parallel/expert.py) and `sequence_counts`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from plait.model.precision import widened
from plait.model.presets import ModelConfig


class Router(nn.Module):
    """Scores per expert, computed in fp32 (float64 in an fp64 run) so routing is the same
    at every lower precision."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(widened(x), widened(self.weight))


class Experts(nn.Module):
    """n SwiGLU experts as stacked weights: w1, w3 (n, hidden, dim); w2 (n, dim, hidden).

    forward takes tokens sorted by expert and the count per expert, and computes every
    expert's rows with one grouped matmul per weight (`grouped=False`: a loop over experts,
    the benchmark's baseline and the fallback where grouped_mm cannot run).
    """

    def __init__(self, n: int, dim: int, hidden: int, grouped: bool = True):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))  # down
        self.grouped = grouped

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # nothing routed here; keep the weights in the graph
            return x + 0 * (self.w1.sum() + self.w2.sum() + self.w3.sum()).to(x.dtype)
        if self.grouped and _grouped_mm_ok(x):
            offs = counts.cumsum(0).to(torch.int32)

            def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return _DenseGrad.apply(F.grouped_mm(a, w.transpose(1, 2), offs=offs))
            return mm(F.silu(mm(x, self.w1)) * mm(x, self.w3), self.w2)
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start:start + n]
            out.append(F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]),
                                self.w2[e]))
            start += n
        return torch.cat(out)


class _DenseGrad(Function):
    """Identity whose backward makes the incoming gradient dense: grouped_mm's backward
    refuses a broadcast one (stride 0, e.g. from `.sum()`)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    # grouped_mm: CPU in fp32/bf16 (float64: the loop); CUDA needs bf16 on sm90+
    if not hasattr(F, "grouped_mm") or x.dtype == torch.float64:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return True


def local_experts(flat: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                  counts: torch.Tensor, experts: Experts, k: int) -> torch.Tensor:
    """The default dispatch: every expert is here. `flat` (T, h) tokens; `slots` the kept
    assignments (token * k + choice) sorted by expert, `counts` per expert; `gates` (T*k,)
    every assignment's gate. Returns (T, h): each token's gated sum over its experts."""
    y = experts(flat[slots // k], counts)
    weighted = y * gates[slots].unsqueeze(-1).to(y.dtype)
    combined = weighted.new_zeros(flat.shape[0] * k, flat.shape[1]).index_copy(0, slots,
                                                                               weighted)
    return combined.view(-1, k, flat.shape[1]).sum(1)


class _BalanceGrad(Function):
    """Identity on the block output that gives the (already scaled) balance loss the
    gradient 1 on the way back, so it trains in every schedule (split backward and
    recomputation included) without the pipeline carrying a second loss. Its backward
    runs once per forward, so the step's routing statistics are counted there."""

    @staticmethod
    def forward(ctx, out, aux, moe, stats):
        ctx.moe, ctx.stats, ctx.aux_dtype = moe, stats, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.moe.record(*ctx.stats)
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device), None, None


class MoE(nn.Module):
    """The block's MLP when the model has experts (see the module docstring)."""

    aux_loss: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n, self.k = cfg.n_experts, cfg.top_k
        self.score, self.norm_topk = cfg.router_score, cfg.norm_topk
        self.aux_coef, self.capacity_factor = cfg.aux_loss_coef, cfg.capacity_factor
        self.groups, self.max_groups = cfg.route_groups, cfg.route_max_groups
        self.bias_rate = cfg.bias_update_rate
        self.routed_scale = cfg.routed_scale
        self.router = Router(cfg.dim, cfg.n_experts)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared = (SharedExperts(cfg.dim, cfg.expert_ffn_dim * cfg.n_shared_experts)
                       if cfg.n_shared_experts else None)
        # selection bias of auxiliary-loss-free balancing; state, not a parameter
        self.register_buffer("bias", torch.zeros(cfg.n_experts), persistent=True)
        self.dispatch: Callable[..., torch.Tensor] = local_experts  # see local_experts
        self.sequence_counts: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.aux_loss_scale = 1.0  # 1 / tokens of the global batch, set by the trainer
        self.reset_state()

    def reset_state(self) -> None:
        """Zero the bias and the step's statistics (after materialising)."""
        with torch.no_grad():
            if self.bias.device.type != "meta":
                self.bias.zero_()
        self.reset_stats()

    def reset_stats(self) -> None:
        """Forget the routing statistics gathered since the last step."""
        self.load = torch.zeros(self.n, dtype=torch.float64, device=self.bias.device)
        self.dropped = 0
        self.aux_sum = 0.0

    def record(self, load: torch.Tensor, dropped: int, aux: float) -> None:
        """Add one micro-batch's routing statistics (called once per backward)."""
        self.load = self.load.to(load.device) + load.double()
        self.dropped += dropped
        self.aux_sum += aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.router(flat)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = self.select(scores.detach(), b)  # (T, k)
        gates = scores.gather(1, chosen)
        if self.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        if self.routed_scale != 1.0:
            gates = gates * self.routed_scale
        per_seq = F.one_hot(chosen.view(b, s * self.k), self.n).sum(1)  # (b, n)
        seq_counts = self.sequence_counts(per_seq)  # whole sequences' counts
        keep = self._capacity_keep(chosen.view(b, s * self.k), seq_counts)
        expert = chosen.reshape(-1)
        # assignments sorted by expert (stable: token order within an expert); dropped last
        if keep is None:
            order = torch.argsort(expert, stable=True)
        else:
            order = torch.argsort(torch.where(keep, expert, self.n), stable=True)
            order = order[:int(keep.sum())]
        counts = torch.bincount(expert[order], minlength=self.n)
        out = self.dispatch(flat, order, gates.reshape(-1), counts, self.experts, self.k)
        if self.shared is not None:
            out = out + self.shared(flat)
        out = out.view(b, s, h)
        aux = self._balance_loss(scores.view(b, s, self.n), seq_counts)
        self.aux_loss = aux.detach()
        if torch.is_grad_enabled() and out.requires_grad:
            dropped = int(flat.shape[0] * self.k - order.numel())
            stats = (per_seq.sum(0).detach(), dropped, float(aux.detach()))
            out = _BalanceGrad.apply(out, aux, self, stats)
        return out

    def select(self, scores: torch.Tensor, batch: int) -> torch.Tensor:
        """Top-k experts per token by scores + bias; ties to the lowest index. With route
        groups, only experts of the best `max_groups` groups (each group scored by the sum
        of its top-(k / max_groups) scores) are eligible: DeepSeek-V3's node limit."""
        sel = scores + self.bias
        if self.groups and self.max_groups and self.max_groups < self.groups:
            g = sel.view(-1, self.groups, self.n // self.groups)
            per = max(1, self.k // self.max_groups)
            group_score = g.sort(dim=-1, descending=True, stable=True)[0][..., :per].sum(-1)
            best = group_score.sort(dim=-1, descending=True, stable=True)[1][:, :self.max_groups]
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            sel = sel.masked_fill(~allowed.repeat_interleave(self.n // self.groups, 1),
                                  float("-inf"))
        return sel.sort(dim=-1, descending=True, stable=True)[1][:, :self.k].contiguous()

    def _capacity_keep(self, chosen: torch.Tensor, seq_counts: torch.Tensor
                       ) -> torch.Tensor | None:
        """Per sequence, the first C assignments of each expert (token order); None when
        dropless."""
        if self.capacity_factor is None:
            return None
        length = int(seq_counts[0].sum()) // self.k  # tokens of a whole sequence
        cap = math.ceil(self.capacity_factor * length * self.k / self.n)
        onehot = F.one_hot(chosen, self.n)  # (b, s*k, n)
        position = (onehot.cumsum(1) * onehot).sum(-1) - 1  # rank within its expert
        return (position < cap).reshape(-1)

    def _balance_loss(self, scores: torch.Tensor, seq_counts: torch.Tensor) -> torch.Tensor:
        """Sequence-wise balance loss of this part of the batch, scaled like the token loss
        (summed over tokens, / tokens in the global batch): per token
        alpha * n * sum_i f_i p_i, f_i = count_i / (k * S) of its sequence."""
        if self.aux_coef <= 0:
            return torch.zeros((), device=scores.device)
        # f_i = count_i / (k S); sequence-mean of the per-token terms over the batch's
        # sequences = (sum over tokens) / (B S): the token loss's scale
        f = (seq_counts / seq_counts.sum(-1, keepdim=True)).unsqueeze(1)  # (b, 1, n)
        per_token = self.aux_coef * self.n * (scores * f).sum(-1)
        return per_token.sum() * self.aux_loss_scale


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class SharedExperts(nn.Module):
    """Always-active experts (DeepSeek-V3), one SwiGLU of their summed width."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
