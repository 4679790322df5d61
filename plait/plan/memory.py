"""Memory per rank, by the ledger's categories: parameters, gradients, optimizer states,
activations (+ logits), communication buffers: the closed-form model the search and
`plait plan` use (`predict_memory(cfg)`, kernels="fused").

All functions take numpy arrays or scalars for the numeric layout sizes: the search scores
every layout at once, for a GPU stack (fused kernels, flash attention). plait's own eager
CPU runtime keeps temporaries no fused kernel does, so a second model walks its schedule
moment by moment (plait/plan/runtime_memory.py, kernels="eager"); where both describe the
same bytes, the model states at the step's end, they agree
(tests/test_plan_memory_agree.py).

Model states (Rajbhandari et al. 2020, "ZeRO", section 5): with Psi parameters, 2 bytes of
fp16/bf16 parameters, 2 of gradients and K = 12 of Adam state (fp32 master copy, momentum,
variance), N_d data-parallel ranks:
  stage 0: (2 + 2 + K) Psi      stage 1: (2 + 2) Psi + K Psi / N_d
  stage 2: 2 Psi + (2 + K) Psi / N_d          stage 3: (2 + 2 + K) Psi / N_d
Megatron keeps fp32 gradients for accumulation (`bf16-fp32grad`: 2 + 4 + 12 = 18 bytes).
plait's ZeRO-2/3 under pp hold their whole gradients through the step (a stage's
accumulate over its micro-batches, reduce-scattered at its last backward: 2 Psi, as
stage 1), and ZeRO-3 with `parallel.zero3_gather = "step"` its whole parameters from the
first forward to the last backward (2 Psi beside the 2 Psi / N_d shard).

Activations per layer: the saved-tensor list of plait/plan/shape.py. For the GPT block with
the math attention kernel (`--arch gpt --attention math`) it reproduces Korthikanti et al.
2022, Table 2: sbh(34 + 5as/h) unsharded; with TP t: sbh(10 + 24/t + 5as/(ht)); with
TP+SP: sbh(34/t + 5as/(ht)); selective recompute drops the 5as/h term; full recompute keeps
only the layer input (2sbh). With flash attention there is no 5as/h term (an fp32
log-sum-exp per head instead), and selective is plait's operator policy (docs/recompute.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from plait.model.recompute_settings import DEFAULT_OPS
from plait.plan.compute import float8_gathered_weights
from plait.plan.schedule_facts import facts
from plait.plan.shape import Shape, activation_terms, per_rank_bytes, selective_terms

Num = Any

# bytes per parameter: (parameters, gradients, Adam states, activations)
PRECISIONS: dict[str, tuple[int, int, int, int]] = {
    "bf16": (2, 2, 12, 2),  # ZeRO paper's mixed precision: fp32 master + m + v
    "bf16-fp32grad": (2, 4, 12, 2),  # Megatron: fp32 gradient accumulation buffer
    "fp32": (4, 4, 8, 4),  # m + v; the parameters are the master copy
    # the parity oracle's precision: everything float64, the parameters their own masters
    "fp64": (8, 8, 16, 8),
    # bf16's states and activations; the blocks' weight GEMMs in float8 (plait/plan/fp8.py)
    "fp8": (2, 2, 12, 2),
    # float8 GEMMs around fp32 or float64 (train.fp8_compute): those formats' bytes
    "fp8-fp32": (4, 4, 8, 4),
    "fp8-fp64": (8, 8, 16, 8),
}
# bytes ZeRO-3's all-gather moves a block-linear weight element where that differs from
# the parameter's: float8 weights are gathered cast (plait/parallel/zero_fp8.py)
LINEAR_GATHER_BYTES: dict[str, int] = {"fp8": 1, "fp8-fp32": 1, "fp8-fp64": 1}
OPTIMIZERS = ("adam", "sgd")
RECOMPUTE = ("none", "selective", "full")


def state_bytes(precision: str, optimizer: str) -> tuple[int, int, int]:
    """Bytes per parameter of (parameters, gradients, optimizer states)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    p, g, k, _ = PRECISIONS[precision]
    if optimizer == "sgd":  # momentum only: drop one fp32 state
        k -= 4
    return p, g, k


def snapshot_bytes(optimizer: str) -> int:
    """Bytes per parameter of the optimizer's shard that post-validation copies before its
    optimistic update and holds until the next step's check (plait/parallel/
    post_validation.py): the fp32 master (cloned even where the fp32 parameter is its own
    master) and, for Adam, the two fp32 moments; the memory meter counts it as optimizer
    states."""
    state_bytes("fp32", optimizer)  # the same names are valid
    return 4 + (8 if optimizer == "adam" else 0)


class ParamTerms(NamedTuple):
    """Parameters a rank holds per piece of the model under tp and the experts' split
    (numbers or arrays)."""

    layer: Num  # a (MoE: its dense part; dense model: whole) layer
    expert: Num  # a MoE layer's routed experts on this rank
    dense_layer: Num  # an MoE model's leading dense layer
    embedding: Num
    head: Num  # the output projection and the final norm


def param_terms(shape: Shape, tp: Num, expert_split: Num) -> ParamTerms:
    """plait replicates an MoE block over tp (plait/parallel/expert.py): its router and
    shared experts are whole on every tp rank, its routed experts split over the
    `expert_split` ranks of expert parallelism only;
    norm gains are whole on every tp rank too (plait/parallel/tensor.py replicates them),
    as are MLA's down-projections and latent norms."""
    mlp_tp = 1.0 if shape.moe else tp
    norms = shape.tp_whole_params()
    final_norm = shape.hidden
    return ParamTerms(
        layer=(shape.attn_params() - norms) / tp + norms + shape.dense_mlp_params() / mlp_tp,
        expert=shape.expert_params() / expert_split,
        dense_layer=(shape.dense_layer_params() - norms) / tp + norms,
        embedding=shape.embedding_params() / tp,
        head=(shape.head_params() - final_norm) / tp + final_norm)


def model_states(params: Num, shard: Num, zero: int, precision: str = "bf16",
                 optimizer: str = "adam", optimizer_sync: str = "barrier",
                 pp: Num = 1, zero3_gather: str = "microbatch") -> dict[str, Num]:
    """Bytes per rank of parameters, gradients, optimizer states for `params` parameters
    replicated over `shard` data-parallel ranks, at ZeRO stage `zero` (ZeRO paper, sec. 5).
    `optimizer_sync="post_validation"`: the optimizer states include the copy of them the
    update keeps until it is validated (`snapshot_bytes`), alive at the update's peak.
    `pp` > 1: ZeRO-2/3's gradients whole during the step; `zero3_gather="step"`: ZeRO-3's
    parameters whole beside their shard (the module docstring)."""
    pb, gb, kb = state_bytes(precision, optimizer)
    if precision == "fp32" and zero >= 1:
        kb += 4  # ZeRO's fp32 master shard is a copy even in fp32 (plait/parallel/zero.py)
    if optimizer_sync == "post_validation":
        kb += snapshot_bytes(optimizer)
    shard = np.asarray(shard, dtype=float)
    gathered = params * pb if zero >= 3 and zero3_gather == "step" else 0.0
    return {
        "parameters": params * pb / (shard if zero >= 3 else 1.0) + gathered,
        "gradients": params * gb / np.where((zero >= 2) & (np.asarray(pp) == 1), shard, 1.0),
        "optimizer states": params * kb / (shard if zero >= 1 else 1.0),
    }


def layer_activations(shape: Shape, mbs: Num, tp: Num, seq_split: Num, sp: bool,
                      recompute: str,
                      act_bytes: int = 2, attention: str = "flash",
                      ops: tuple[str, ...] = DEFAULT_OPS) -> Num:
    """Bytes one layer keeps for one micro-batch on one rank under `recompute`:

      none       every tensor the layer saves (shape.activation_terms; what `attention`
                 keeps: flash an fp32 log-sum-exp, math the a*s probabilities per token);
      selective  math: Korthikanti et al.'s, the probabilities (and their dropout) dropped
                 and recomputed with the attention core; flash (no probabilities to drop):
                 plait's operator policy, the layer input and the outputs of the groups not
                 in `ops` (shape.selective_terms, the runtime's list);
      full       the layer input only.

    Korthikanti et al. 2022, section 4 / Table 2 are the `--arch gpt`, math sums.
    A sequence split over `seq_split` ranks (context parallelism): each rank keeps
    s / seq_split tokens (its queries attend to all s keys)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; use one of {', '.join(RECOMPUTE)}")
    tokens = np.asarray(mbs, dtype=float) * shape.seq / np.asarray(seq_split, dtype=float)
    terms = activation_terms(shape, act_bytes, attention=attention)
    if recompute == "full":
        terms = [t for t in terms if t.keep_full]
    elif recompute == "selective" and attention == "math":
        terms = [t for t in terms if not t.scores]
    elif recompute == "selective":
        terms = selective_terms(shape, act_bytes, attention=attention, ops=ops)
    return tokens * sum(per_rank_bytes(t, shape, tp, sp) for t in terms)


def inflight_chunks(schedule: str, pp: Num, m: Num, v: Num) -> tuple[Num, Num]:
    """Closed-form micro-batch x chunk activation sets alive at the peak on the first and
    on the last pipeline rank (used for ranking; shown numbers come from the simulator):
    the schedule's `peak_inflight` (plait/plan/schedule_facts.py), with its citations.

    1f1b: p on rank 0 (Narayanan et al. 2021); interleaved: p*v + p - 1 chunks of L/(pv)
    layers, i.e. the (1 + (p-1)/(pv)) penalty (Korthikanti et al. 2022, sec. 4.2.3 /
    Megatron); zb-h1 as 1F1B, zb-h2 2p-1 (Qi et al. 2023); zb-v 2p chunks of L/(2p);
    dualpipe p+1 stages' worth, dualpipev the same in half-size chunks (DeepSeek-V3, Table 2).
    """
    p, m, v = (np.asarray(x, dtype=float) for x in (pp, m, v))
    one = np.ones_like(p * m)
    first, last = facts(schedule).peak_inflight(p, m, v, np.minimum)
    return first * one, last * one


def logits_bytes(shape: Shape, mbs: Num, tp: Num, seq_split: Num, act_bytes: int = 2) -> Num:
    """Logits of one micro-batch on the last stage: the activation-dtype logits kept for the
    backward plus the fp32 copy the loss computes softmax in (vocab-parallel over tp), for
    the rank's s / seq_split tokens."""
    tokens = np.asarray(mbs, dtype=float) * shape.seq / np.asarray(seq_split, dtype=float)
    return tokens * shape.vocab * (act_bytes + 4) / np.asarray(tp, dtype=float)


def comm_buffers(shape: Shape, mbs: Num, tp: Num, seq_split: Num, pp: Num, zero: int,
                 layer_params_rank: Num, sp: bool, precision: str) -> Num:
    """Transient buffers alive at the peak: the SP all-gather output, pipeline send/recv,
    the split sequence's ring-attention K/V double buffer, MoE dispatch/combine, ZeRO-3's
    gathered layer (the current and the prefetched one) and its unsharded gradient before
    reduce-scatter (under fp8 the block linears' weights gathered at 1 byte an element,
    LINEAR_GATHER_BYTES)."""
    e = PRECISIONS[precision][3]
    pb, gb, _ = state_bytes(precision, "adam")
    tp, seq_split, pp = (np.asarray(x, dtype=float) for x in (tp, seq_split, pp))
    tokens = np.asarray(mbs, dtype=float) * shape.seq / seq_split
    act = tokens * shape.hidden * e
    total = np.where(tp > 1, act, 0.0) if sp else 0.0
    total = total + np.where(pp > 1, 2 * act / (tp if sp else 1.0), 0.0)
    total = total + np.where(seq_split > 1, 2 * tokens * shape.kv_exchange_dim * e / tp, 0.0)
    if shape.moe:
        # dispatch and combine buffers; the block is replicated over tp, its tokens split
        # over tp only under SP
        total = total + 2 * tokens * shape.top_k * shape.hidden * e / (tp if sp else 1.0)
    if zero >= 3:
        total = total + layer_params_rank * (2 * pb + gb)
        if precision in LINEAR_GATHER_BYTES:  # the gathered block linears' smaller copies
            linear = float8_gathered_weights(shape, tp)
            total = total - 2 * linear * (pb - LINEAR_GATHER_BYTES[precision])
    return total
