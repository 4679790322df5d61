"""Configuration: typed dataclasses, TOML loading, `--set a.b=c` overrides, validation.

`validate()` returns *every* problem at once, each naming the fix, and runs before any
process group exists. The global batch is set once (`train.global_batch`, in sequences);
the number of micro-batches per step is derived from it and the layout.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.config import checks
from plait.config.compile_checks import compile_problems
from plait.config.fp8_checks import fp8_problems
from plait.config.muon_checks import muon_problems
from plait.config.overlap_checks import overlap_fb_problems
from plait.config.values import coerce_value
from plait.dims import AXES, DEFAULT_ORDER, DIMENSIONS
from plait.dims import problems as dimension_problems
from plait.model.presets import PRESETS, ModelConfig

# pure Python, no torch: the schedule layer sits below config (tests/test_layering.py)

# bucketed DP's first bucket cap in MB (torch DDP's 1 MiB first bucket): its all-reduce
# starts early in backward (plait/parallel/data.py; the planner's last bucket,
# plait/plan/comm/step.py)
FIRST_BUCKET_MB = 1.0
# ZeRO's gradient reduce-scatters in flight during backward (plait/parallel/zero.py): each
# more holds one more unit's flat gradient, its output and gloo's chunks (the eager memory
# model). One: where ranks share CPU cores a second in flight is slower
# (benchmarks/zero_vs_torch.py measures it); on a GPU, where the collective runs beside the
# compute, two may pay (a setting to measure there)
ZERO_REDUCE_SCATTERS_IN_FLIGHT = 1


def _model_range_problems(m: ModelConfig) -> list[str]:
    """Sizes every other check divides by, and the positive scalars."""
    problems = [f"model.{name}={getattr(m, name)} must be >= 1"
                for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                             "ffn_dim", "max_seq_len") if getattr(m, name) < 1]
    problems += [f"model.{name}={getattr(m, name)} must be > 0"
                 for name in ("rope_theta", "norm_eps", "init_std", "rope_scaling_factor",
                              "rope_low_freq_factor", "rope_original_max_len")
                 if getattr(m, name) <= 0]
    if m.rope_scaling_factor != 1.0 and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        problems.append(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be > "
                        f"model.rope_low_freq_factor={m.rope_low_freq_factor}")
    return problems + [f"model.{name}={getattr(m, name)} must be >= 0"
                       for name in ("n_experts", "top_k", "expert_ffn_dim", "n_shared_experts")
                       if getattr(m, name) < 0]


class ConfigError(ValueError):
    """One or more configuration problems; the message lists each with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class ParallelConfig:
    dp: int = 1
    # hybrid sharding (plait/dims/dp_replicate.py): ZeRO shards over dp_shard ranks (x cp)
    # and all-reduces the reduced shards over dp_replicate groups; dp = dp_shard x
    # dp_replicate (dp_shard 0: dp / dp_replicate; load_config derives dp from both)
    dp_shard: int = 0
    dp_replicate: int = 1
    # the dp_replicate groups as units of failure (plait/parallel/fault_tolerance.py): a
    # replica that dies or stops answering for replica_timeout_s leaves, the others finish
    # the step without it, and a replacement joins from a live peer
    fault_tolerance: bool = False
    replica_timeout_s: float = 30.0
    min_replicas: int = 1  # fewer live: a step waits for replacements to join
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # expert parallel's all-to-all (plait/parallel/expert.py): a row per "assignment" (k a
    # token), or per "token" and destination rank (a token whose experts share a rank once)
    ep_dispatch: str = "assignment"
    zero: int = 0
    sp: bool = False
    # sequence parallel's all-gather and reduce-scatter decomposed into ring hops that
    # overlap the matmuls beside them (plait/parallel/async_tp.py)
    async_tp: bool = False
    # DualPipe's F&B pairs run overlapped: one micro-batch's all-to-alls in flight under
    # the other's compute (plait/parallel/pipeline/fb_overlap.py)
    overlap_fb: bool = False
    # context parallel (plait/parallel/context.py): "ring" (Liu et al. 2023) or "allgather"
    # K/V (Llama 3); "zigzag" (rank i: chunks i and 2cp-1-i of 2cp) or "contiguous" slices
    cp_mode: str = "ring"
    cp_layout: str = "zigzag"
    # hierarchical cp: ranks per all-to-all group (a divisor of cp); 0: a node's cp ranks
    cp_a2a: int = 0
    schedule: str = "1f1b"
    # Pipeline stages per rank; None: the schedule's own (its registry entry: 2 for
    # interleaved and the V schedules zb-v / dualpipev, else 1).
    virtual_stages: int | None = None
    # Micro-batches per step per data-parallel replica. None: derived from
    # train.micro_batch_size, or 1 (pp for pipelines) when neither is given.
    microbatches: int | None = None
    data_parallel: str = "bucketed"  # "naive" | "bucketed"
    # pipelines: "barrier" (the step's grad norm and finiteness check are one all-reduce
    # over the world before any rank updates) or "post_validation" (each stage updates as
    # soon as its gradients are ready, the check travels over pp and a failed one rolls
    # the update back: plait/parallel/post_validation.py, Qi et al. 2024, section 4)
    optimizer_sync: str = "barrier"
    # bucketed DP's bucket, the first at most FIRST_BUCKET_MB (parallel/data.py); ZeRO-1/2's
    # units of consecutive modules (parallel/zero_units.py)
    bucket_mb: float = 25.0
    # ZeRO-3's parameter gathers (parallel/zero.py): "microbatch" (around each forward and
    # each backward, freed after: least memory) or "step" (a unit stays gathered from its
    # first use until its stage's last backward: one all-gather a unit a step)
    zero3_gather: str = "microbatch"
    order: tuple[str, ...] = DEFAULT_ORDER
    gpus_per_node: int = 8

    @property
    def world_size(self) -> int:
        """Ranks of the layout: the product of the rank grid's axes (plait/dims/)."""
        return math.prod(getattr(self, d.name) for d in AXES)


@dataclass
class TrainConfig:
    global_batch: int = 8  # sequences per optimizer step, over all replicas
    micro_batch_size: int | None = None  # sequences per micro-batch per replica
    seq_len: int = 64
    steps: int = 20
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    # "adamw" | "sgd" | "muon": plain SGD (no momentum, no weight decay) is scale-sensitive,
    # the parity check that a gradient off by a constant factor cannot pass (docs/parity.md);
    # Muon (plait/muon.py, docs/muon.md) orthogonalises each hidden matrix's momentum
    optimizer: str = "adamw"
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    # the orthogonalised update's factor: "moonlight" (0.2 * sqrt(max(A, B)): AdamW's RMS,
    # so lr and weight decay carry over) or "original" (sqrt(max(1, A / B)))
    muon_scale: str = "moonlight"
    # the Newton-Schulz iteration's dtype: "bf16" (published), "fp32" or "fp64" (parity)
    muon_ns_dtype: str = "bf16"
    # "fp32" | "bf16" (bf16 compute, fp32 master weights) | "fp8" (bf16, and the blocks'
    # linears in float8: plait/parallel/fp8.py) | "fp64" (everything in float64: the
    # parity oracle's precision, and a divergence's debugger; plait/model/precision.py)
    precision: str = "fp32"
    # under precision "fp8": the dtype of everything but the float8 GEMMs, and of those
    # GEMMs' accumulation: "bf16" (a real run), "fp32" or "fp64" (proof: the float8
    # quantisation is then the only difference between layouts' roundings, docs/parity.md)
    fp8_compute: str = "bf16"
    # under precision "fp8": "tensorwise" (one scale a tensor: plait/model/fp8.py) or
    # "blockwise" (DeepSeek-V3's: activations in 1 x fp8_block tiles, weights in
    # fp8_block x fp8_block blocks, promoted every fp8_block: plait/model/fp8_blockwise.py)
    fp8_recipe: str = "tensorwise"
    fp8_block: int = 128
    recompute: str = "none"  # "none" | "selective" | "full" (per block; docs/recompute.md)
    # selective: the operator groups recomputed; the others' outputs are saved
    # (plait/model/recompute.py: matmul, attention, elementwise)
    recompute_ops: tuple[str, ...] = ("attention", "elementwise")
    # torch.compile each transformer block's forward (plait/parallel/compile.py), with
    # this backend: "inductor" (generated kernels), "aot_eager" or "eager" (traced only)
    compile: bool = False
    compile_backend: str = "inductor"
    seed: int = 1234
    data: str | None = None  # token file (.bin with .json beside it); None: default corpus
    # starting weights: "hf:DIR" (a Hugging Face Llama directory) or a plait checkpoint;
    # None: the name-seeded init (plait/checkpoint/init_from.py, docs/huggingface.md)
    init_from: str | None = None
    memory_step: int = -1  # measure memory by category during this step (-1: never)
    # validation during training (plait/train/held_out.py): every eval_every steps and
    # after the last, the loss over the first eval_sequences windows of eval_data (a token
    # file like train.data; None: every whole global batch of it), forward only
    eval_every: int | None = None
    eval_data: str | None = None
    eval_sequences: int | None = None
    # packed documents (plait/model/packed.py): each window of the token file holds the
    # documents its end-of-document tokens end; attention never crosses one, positions
    # restart with each, the loss never predicts across a boundary
    documents: bool = False
    # a step whose global grad norm is not finite skips its update; this many in a row
    # stop the run (plait/train/loop.py, docs/checkpoint.md)
    max_nonfinite_steps: int = 3


@dataclass
class Config:
    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model_name: str = "tiny"

    # ---- derived quantities (never stored twice) ---------------------------------
    def microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel replica."""
        p, t = self.parallel, self.train
        if p.microbatches is not None:
            return p.microbatches
        per_replica = t.global_batch // max(p.dp, 1)
        if t.micro_batch_size:
            return max(per_replica // t.micro_batch_size, 1)
        return p.pp if p.pp > 1 else 1

    def micro_batch_size(self) -> int:
        return self.train.global_batch // (self.parallel.dp * self.microbatches())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- validation ------------------------------------------------------------
    # Each step returns its problems; the order of the steps is the order they are shown.
    def validate(self, world_size: int | None = None) -> list[str]:
        """Every problem with this configuration, each naming the fix. Empty when valid."""
        p = self.parallel
        problems = [f"parallel.{name}={getattr(p, name)} must be >= 1"
                    for name in (d.name for d in DIMENSIONS) if getattr(p, name) < 1]
        problems += _model_range_problems(self.model)
        if problems:  # every later check divides by these sizes
            return problems
        return (checks.parallel_problems(self, world_size) + checks.model_problems(self)
                + dimension_problems(self) + checks.moe_problems(self)
                + checks.unbuilt_problems(self) + checks.batch_problems(self)
                + checks.train_problems(self) + fp8_problems(self) + compile_problems(self)
                + muon_problems(self) + overlap_fb_problems(self))

    def warnings(self) -> list[str]:
        """Settings that are valid but probably not what was meant, or worth saying."""
        notes: list[str] = []
        m, p = self.model, self.parallel
        if p.zero > 0 and p.dp == 1:
            notes.append(f"zero={p.zero} with dp=1 shards over one rank: it does "
                         "nothing but add copies; use dp > 1 or zero=0")
        if p.tp > 1 and m.vocab_size % p.tp:
            padded = -(-m.vocab_size // p.tp) * p.tp
            notes.append(
                f"tp={p.tp} does not divide model.vocab_size={m.vocab_size}: the embedding "
                f"and LM head are padded to {padded} rows ({padded - m.vocab_size} never "
                "used, masked out of the loss)")
        notes += self._bubble_notes()
        if p.tp > p.gpus_per_node:
            notes.append(
                f"tp={p.tp} is larger than gpus_per_node={p.gpus_per_node}: tensor-parallel "
                "all-reduces cross nodes every layer (Stanford CS336 lecture 8 reports a 42% "
                f"throughput drop going from 8 to 16 GPUs); keep tp <= {p.gpus_per_node}")
        return notes

    def _bubble_notes(self) -> list[str]:
        """Fewer micro-batches than pipeline stages: most of each step is bubble."""
        from plait.schedule.registry import closed_form_bubble, natural_virtual_stages
        from plait.schedule.simulate import Durations

        p = self.parallel
        m = self.microbatches()
        if p.pp == 1 or m >= p.pp:
            return []
        v = natural_virtual_stages(p.schedule, p.virtual_stages)
        uniform = Durations(1.0, 1.0, 1.0)
        now = closed_form_bubble(p.schedule, p.pp, m, v, uniform)
        more = 4 * p.pp  # the usual rule of thumb: m >= 4 pp keeps the bubble small
        then = closed_form_bubble(p.schedule, p.pp, more, v, uniform)
        if now is None or then is None:
            return []
        return [f"pp={p.pp} with {m} micro-batch{'es' * (m > 1)} per step: about {now:.0%} "
                f"of each rank's step is pipeline bubble ({p.schedule}, uniform stages); "
                f"more micro-batches shrink it (--microbatches {more}: {then:.0%}; "
                f"--global-batch a multiple of {p.dp * more})"]

    def check(self, world_size: int | None = None) -> Config:
        problems = self.validate(world_size)
        if problems:
            raise ConfigError(problems)
        return self


# ---- loading and overrides ----------------------------------------------------------

_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set `section.field` (e.g. `train.lr`) on cfg, parsing strings to the field's type."""
    section, _, name = dotted.partition(".")
    if section not in _SECTIONS or not name:
        raise ConfigError([f"unknown setting {dotted!r}; use model.X, parallel.X or train.X"])
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        raise ConfigError(
            [f"unknown setting {dotted!r}; {section} has: {', '.join(sorted(fields))}"]
        )
    type_name = str(fields[name].type)
    try:
        parsed = coerce_value(value, type_name)
    except ValueError as e:
        raise ConfigError([f"{dotted}={value!r}: {e}"]) from None
    if section == "model":
        cfg.model = dataclasses.replace(cfg.model, **{name: parsed})
    else:
        setattr(obj, name, parsed)


def _read_toml(path: Path) -> dict[str, Any]:
    """The TOML file's tables; every way it can be unreadable is a ConfigError."""
    if not path.is_file():
        kind = "is a directory" if path.is_dir() else "not found"
        raise ConfigError([f"config file {str(path)!r} {kind}; give a TOML file"])
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError([f"config file {path} is not valid TOML ({e}); fix that line"]) from None
    except OSError as e:
        raise ConfigError([f"config file {path} cannot be read ({e.strerror})"]) from None


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> Config:
    """Build a Config: defaults, then the TOML file, then `overrides`, then `--set` strings.

    A TOML file has `model = "tiny"` (a preset name) or a `[model]` table (preset fields
    overridden), and `[parallel]`, `[train]` tables. A preset in `overrides` (`--model`)
    replaces the file's model wholly: the file's `[model]` fields describe the file's
    preset, not the one asked for (`plait plan --emit-config` writes them all).
    """
    cfg = Config()
    problems: list[str] = []
    items: list[tuple[str, Any]] = []
    if path is not None:
        data = _read_toml(Path(path))
        p = Path(path)
        preset = data.pop("model_name", None)
        model = data.get("model")
        if isinstance(model, str):
            preset, model = model, None
            data.pop("model")
        if preset is not None:
            items.append(("model_name", preset))
        for section, table in data.items():
            if section not in _SECTIONS or not isinstance(table, dict):
                problems.append(f"{p}: unknown table [{section}]; use model, parallel, train")
                continue
            items.extend((f"{section}.{k}", v) for k, v in table.items())
    if (overrides or {}).get("model_name") is not None:
        items = [(k, v) for k, v in items if k != "model_name" and not k.startswith("model.")]
    items.extend((overrides or {}).items())
    for s in sets or []:
        key, eq, value = s.partition("=")
        if not eq:
            problems.append(f"--set {s!r} must look like section.name=value")
            continue
        items.append((key.strip(), value))
    # a preset choice applies first so that field overrides land on top of it
    for key, value in items:
        if key == "model_name" and value is not None:
            if value not in PRESETS:
                problems.append(f"unknown model preset {value!r}; known: {', '.join(PRESETS)}")
            else:
                cfg.model, cfg.model_name = PRESETS[value], value
    for key, value in items:
        if key == "model_name" or value is None:
            continue
        try:
            set_value(cfg, key, value)
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    _derive_dp(cfg, explicit_dp=any(k == "parallel.dp" for k, v in items if v is not None))
    return cfg


def _derive_dp(cfg: Config, explicit_dp: bool) -> None:
    """dp from hybrid sharding's two sizes when they are given and dp is not (validation
    names a dp given that is not their product); dp_replicate alone: one rank a shard
    group, dp = dp_replicate."""
    p = cfg.parallel
    if explicit_dp:
        return
    if p.dp_shard > 0 and p.dp_replicate > 0:
        p.dp = p.dp_shard * p.dp_replicate
    elif p.dp_shard == 0 and p.dp_replicate > 1:
        p.dp = p.dp_replicate
