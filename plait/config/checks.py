"""The steps of `Config.validate()`: each returns its problems, each naming the fix.

A module of their own so that plait/config/schema.py stays one readable file; the order in
which `validate` calls them is the order the problems are shown. The schema imports this
module, so this one names `Config` for its annotations only (never imported at run time)
and reads the mesh's dimensions from dims.py: the two do not import each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.dims import DIMS
from plait.dims.record import divisors_text
from plait.model.recompute_settings import MODES as RECOMPUTE_MODES
from plait.model.recompute_settings import ops_problems
from plait.schedule.registry import SCHEDULE_NAMES, SCHEDULES

if TYPE_CHECKING:
    from plait.config.schema import Config



def parallel_problems(cfg: Config, world_size: int | None) -> list[str]:
    """The layout against the world, and the parallel settings' own ranges."""
    p = cfg.parallel
    checks = [
        (world_size is not None and p.world_size != world_size,
         f"layout {'*'.join(DIMS)} = {'*'.join(str(getattr(p, d)) for d in DIMS)} = "
         f"{p.world_size} does not "
         f"match the world size {world_size}; change the layout or launch "
         f"{p.world_size} ranks (--nproc {p.world_size})"),
        (sorted(p.order) != sorted(DIMS),
         f"parallel.order={','.join(p.order)} must name each of {', '.join(DIMS)} once"),
        (p.zero not in (0, 1, 2, 3),
         f"parallel.zero={p.zero} is not a ZeRO stage; use 0, 1, 2 or 3"),
        (p.data_parallel not in ("naive", "bucketed"),
         f"parallel.data_parallel={p.data_parallel!r}; use 'naive' or 'bucketed'"),
        (p.bucket_mb <= 0, f"parallel.bucket_mb={p.bucket_mb} must be > 0"),
        (p.zero3_gather not in ZERO3_GATHERS,
         f"parallel.zero3_gather={p.zero3_gather!r}; use one of "
         f"{', '.join(map(repr, ZERO3_GATHERS))}"),
        (p.schedule not in SCHEDULES,
         f"parallel.schedule={p.schedule!r}; use one of {', '.join(SCHEDULE_NAMES)}"),
        (p.gpus_per_node < 1, f"parallel.gpus_per_node={p.gpus_per_node} must be >= 1"),
        (p.optimizer_sync not in OPTIMIZER_SYNCS,
         f"parallel.optimizer_sync={p.optimizer_sync!r}; use 'barrier' or "
         "'post_validation'"),
        (p.virtual_stages is not None and p.virtual_stages < 1,
         f"parallel.virtual_stages={p.virtual_stages} must be >= 1 (leave it out for "
         "the schedule's own)"),
    ]
    return [problem for broken, problem in checks if broken]

def model_problems(cfg: Config) -> list[str]:
    """The model's own shape: heads, head dim."""
    problems: list[str] = []
    m = cfg.model
    if m.n_heads % m.n_kv_heads:
        problems.append(
            f"model.n_kv_heads={m.n_kv_heads} does not divide n_heads={m.n_heads}; use one "
            f"of {divisors_text(m.n_heads)}"
        )
    if m.attention not in ATTENTIONS:
        problems.append(f"model.attention={m.attention!r}; use one of "
                        f"{', '.join(map(repr, ATTENTIONS))}")
    if m.mla:
        return problems + mla_problems(cfg)
    if m.dim % m.n_heads:
        problems.append(f"model.dim={m.dim} is not a multiple of n_heads={m.n_heads}")
    elif (m.dim // m.n_heads) % 2:
        problems.append(f"head dim {m.dim // m.n_heads} must be even for RoPE")
    return problems


ATTENTIONS = ("gqa", "mla")  # plait/model/transformer.py make_attention


def mla_problems(cfg: Config) -> list[str]:
    """Multi-head latent attention's widths (plait/model/mla.py)."""
    m = cfg.model
    problems = [f"model.{name}={getattr(m, name)} must be >= 1 with model.attention='mla'"
                for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                             "v_head_dim") if getattr(m, name) < 1]
    checks = [
        (m.q_lora_rank < 0, f"model.q_lora_rank={m.q_lora_rank} must be >= 0 (0: queries "
         "without a latent)"),
        (m.qk_rope_head_dim % 2, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even "
         "for RoPE (it rotates pairs)"),
        (m.n_kv_heads != m.n_heads, f"model.n_kv_heads={m.n_kv_heads}: multi-head latent "
         f"attention has a key and a value per head; set model.n_kv_heads={m.n_heads} "
         "(= model.n_heads)"),
    ]
    return problems + [problem for broken, problem in checks if broken]

def unbuilt_problems(cfg: Config) -> list[str]:
    """Strategies and combinations not built yet: refused, never silently ignored."""
    problems: list[str] = []
    m, p = cfg.model, cfg.parallel
    if p.zero > 0 and m.tie_embeddings:
        problems.append("ZeRO shards each parameter within one module: set "
                        "model.tie_embeddings=false, or zero=0")
    if m.mtp_depth:
        problems.append(f"model.mtp_depth={m.mtp_depth}: multi-token prediction modules "
                        "are counted by the planner (plait plan) but not built by the "
                        "runtime; set model.mtp_depth=0 to train")
    return problems + post_validation_problems(cfg)


OPTIMIZER_SYNCS = ("barrier", "post_validation")
ZERO3_GATHERS = ("microbatch", "step")  # plait/parallel/zero.py GATHERS


def post_validation_problems(cfg: Config) -> list[str]:
    """What the post-validated optimizer step (plait/parallel/post_validation.py) does not
    cover: refused here, before any rank starts."""
    m, p = cfg.model, cfg.parallel
    if p.optimizer_sync != "post_validation":
        return []
    checks = [
        (p.pp == 1, "parallel.optimizer_sync=post_validation removes the barrier between "
         "pipeline steps, but pp=1; use --pp > 1 or optimizer_sync=barrier"),
        (bool(m.n_experts), "parallel.optimizer_sync=post_validation with an MoE model: "
         "the router's balancing bias and statistics are reduced at the step's end, before "
         "the step is validated; use optimizer_sync=barrier with model.n_experts > 0"),
    ]
    return [problem for broken, problem in checks if broken]


def moe_problems(cfg: Config) -> list[str]:
    """The MoE block's own settings (plait/model/moe.py); expert parallel's layout is its
    record's (plait/dims/)."""
    m = cfg.model
    if not m.n_experts:
        return []
    n, k = m.n_experts, m.top_k
    checks = [
        (not 1 <= k <= n, f"model.top_k={k} must be between 1 and model.n_experts={n}"),
        (m.expert_ffn_dim < 1, f"model.expert_ffn_dim={m.expert_ffn_dim} must be >= 1"),
        (m.router_score not in ("softmax", "sigmoid"),
         f"model.router_score={m.router_score!r}; use 'softmax' or 'sigmoid'"),
        (m.aux_loss_coef < 0, f"model.aux_loss_coef={m.aux_loss_coef} must be >= 0"),
        (m.routed_scale <= 0, f"model.routed_scale={m.routed_scale} must be > 0 (1: the "
         "gates as routed)"),
        (m.bias_update_rate < 0,
         f"model.bias_update_rate={m.bias_update_rate} must be >= 0 (0: no bias balancing)"),
        (m.capacity_factor is not None and m.capacity_factor <= 0,
         f"model.capacity_factor={m.capacity_factor} must be > 0, or none for dropless "
         "routing"),
        (not 0 <= m.n_dense_layers <= m.n_layers,
         f"model.n_dense_layers={m.n_dense_layers} must be between 0 and model.n_layers="
         f"{m.n_layers}"),
    ]
    problems = [msg for bad, msg in checks if bad]
    g, mg = m.route_groups, m.route_max_groups
    if g or mg:
        if g < 1 or n % g or not 1 <= mg <= g:
            problems.append(f"model.route_groups={g} must divide the {n} experts and "
                            f"model.route_max_groups={mg} be between 1 and it")
        elif mg * (n // g) < k:
            problems.append(f"model.route_max_groups={mg} groups of {n // g} experts hold "
                            f"fewer than top_k={k}; raise route_max_groups")
    return problems


def batch_problems(cfg: Config) -> list[str]:
    """Batch arithmetic: the global batch is set once, everything else derives from it."""
    p, t = cfg.parallel, cfg.train
    if t.global_batch < 1:
        return [f"train.global_batch={t.global_batch} must be >= 1"]
    if t.global_batch % p.dp:
        return [f"train.global_batch={t.global_batch} is not divisible by dp={p.dp}; use "
                f"a multiple of {p.dp}"]
    problems: list[str] = []
    per_replica = t.global_batch // p.dp
    if p.microbatches is not None and p.microbatches < 1:
        problems.append(f"parallel.microbatches={p.microbatches} must be >= 1")
    elif p.microbatches is not None and per_replica % p.microbatches:
        problems.append(
            f"{per_replica} sequences per replica (global_batch {t.global_batch} / dp "
            f"{p.dp}) do not split into {p.microbatches} micro-batches; use one of "
            f"{divisors_text(per_replica)}"
        )
    if t.micro_batch_size is None:
        return problems + _derived_split_problems(cfg, per_replica)
    if t.micro_batch_size < 1 or per_replica % t.micro_batch_size:
        problems.append(
            f"train.micro_batch_size={t.micro_batch_size} does not divide the "
            f"{per_replica} sequences per replica; use one of {divisors_text(per_replica)}"
        )
    elif p.microbatches is not None and p.microbatches * t.micro_batch_size != per_replica:
        problems.append(
            f"parallel.microbatches={p.microbatches} and train.micro_batch_size="
            f"{t.micro_batch_size} disagree ({per_replica} sequences per replica); "
            "set only one of them"
        )
    return problems

def _derived_split_problems(cfg: Config, per_replica: int) -> list[str]:
    """Neither micro-batches nor their size given: a pipeline takes pp micro-batches,
    which must each get whole sequences (fewer sequences than stages would leave a
    micro-batch of zero rows; a remainder would be dropped silently)."""
    p, t = cfg.parallel, cfg.train
    if p.microbatches is not None or p.pp == 1 or per_replica % p.pp == 0:
        return []
    fits = -(-t.global_batch // (p.dp * p.pp)) * p.dp * p.pp
    return [f"{per_replica} sequences per replica (global_batch {t.global_batch} / dp "
            f"{p.dp}) do not split into the pp={p.pp} micro-batches a pipeline takes by "
            f"default; use --global-batch {fits} (a multiple of dp x pp = {p.dp * p.pp}), or "
            f"--microbatches one of {divisors_text(per_replica)}"]


def train_problems(cfg: Config) -> list[str]:
    """The training settings' own ranges (sequence, steps, precision, optimizer, LR)."""
    m, t = cfg.model, cfg.train
    checks = [
        (t.seq_len < 1, f"train.seq_len={t.seq_len} must be >= 1"),
        (t.seq_len >= 1 and t.seq_len > m.max_seq_len,
         f"train.seq_len={t.seq_len} is longer than the model's max_seq_len="
         f"{m.max_seq_len}; use --seq-len {m.max_seq_len} or less, or raise "
         "model.max_seq_len"),
        (t.steps < 1, f"train.steps={t.steps} must be >= 1; use --steps 1 or more"),
        (t.precision not in ("fp32", "bf16", "fp8", "fp64"),
         f"train.precision={t.precision!r}; use 'fp32', 'bf16', 'fp8' or 'fp64'"),
        (t.fp8_compute not in ("bf16", "fp32", "fp64"),
         f"train.fp8_compute={t.fp8_compute!r}; use 'bf16', 'fp32' or 'fp64'"),
        (t.fp8_compute != "bf16" and t.precision != "fp8",
         f"train.fp8_compute={t.fp8_compute!r} applies to --precision fp8 only (it is "
         f"{t.precision!r}); drop the setting or use --precision fp8"),
        (t.precision == "fp8" and m.n_experts > 0 and t.fp8_recipe == "tensorwise",
         "train.precision='fp8' with the tensorwise recipe is not built for MoE models (the "
         "routed experts' grouped GEMMs have no per-tensor float8 path); use --fp8-recipe "
         "blockwise or --precision bf16"),
        (t.recompute not in RECOMPUTE_MODES,
         f"train.recompute={t.recompute!r}; use 'none', 'selective' or 'full'"),
        (t.lr <= 0, f"train.lr={t.lr} must be > 0"),
        (t.grad_clip < 0,
         f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)"),
        (t.optimizer not in ("adamw", "sgd", "muon"),
         f"train.optimizer={t.optimizer!r}; use 'adamw', 'sgd' or 'muon'"),
        (t.optimizer == "sgd" and bool(t.weight_decay),
         f"train.optimizer='sgd' has no weight decay; set train.weight_decay=0 (it is "
         f"{t.weight_decay})"),
        (not 0 <= t.min_lr_ratio <= 1,
         f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]"),
        (t.warmup_steps < 0, f"train.warmup_steps={t.warmup_steps} must be >= 0"),
        (t.documents and cfg.parallel.fault_tolerance,
         "train.documents with parallel.fault_tolerance is not built (a lost replica's "
         "rows change the step's kept targets); train one of them"),
        (t.weight_decay < 0, f"train.weight_decay={t.weight_decay} must be >= 0"),
        (not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1),
         f"train.beta1={t.beta1} and train.beta2={t.beta2} must be in [0, 1)"),
        (t.eps <= 0, f"train.eps={t.eps} must be > 0"),
        # against the run's steps only once they are valid: a bad --steps is one problem
        (t.steps >= 1 and (t.memory_step < -1 or t.memory_step >= t.steps),
         f"train.memory_step={t.memory_step} is not a step of this run; use 0 to "
         f"{t.steps - 1}, or -1 for none"),
    ]
    return ([problem for broken, problem in checks if broken] + ops_problems(t.recompute_ops)
            + eval_problems(cfg))


def eval_problems(cfg: Config) -> list[str]:
    """Validation during training: a positive cadence, and the held-out file it reads
    (the file itself is checked by plait/train/checks.py)."""
    t = cfg.train
    if t.eval_every is None:
        return ["train.eval_data is read only with --eval-every N; add it, or leave out "
                "--eval-data"] if t.eval_data is not None else []
    checks = [
        (t.eval_every < 1, f"--eval-every {t.eval_every}: evaluate every N >= 1 steps "
         "(train.eval_every), or leave it out for no evaluation"),
        (t.eval_data is None, "--eval-every needs the held-out token file: add --eval-data "
         "FILE.bin (same format as --data)"),
        (t.eval_sequences is not None and t.eval_sequences < 1,
         f"train.eval_sequences={t.eval_sequences} must be >= 1 (leave it out for every "
         "whole batch of --eval-data)"),
    ]
    return [problem for broken, problem in checks if broken]

