"""Configuration: typed dataclasses, TOML loading, `--set a.b=c` overrides, validation.

`validate()` returns *every* problem at once, each naming the fix, and runs before any
process group exists. The global batch is set once (`train.global_batch`, in sequences);
the number of micro-batches per step is derived from it and the layout.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.config_values import coerce_value
from plait.model.presets import PRESETS, ModelConfig

# pure Python, no torch: the schedule layer sits below config (tests/test_layering.py)
from plait.parallel.pipeline.registry import (
    SCHEDULE_NAMES,
    SCHEDULES,
    natural_virtual_stages,
    validate_schedule_request,
)

DIMS = ("dp", "pp", "cp", "tp")  # the mesh dimensions; ep is laid over dp x cp
DEFAULT_ORDER = ("tp", "cp", "pp", "dp")  # innermost first: tp stays inside a node


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _model_range_problems(m: ModelConfig) -> list[str]:
    """Sizes every other check divides by, and the positive scalars."""
    problems = [f"model.{name}={getattr(m, name)} must be >= 1"
                for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                             "ffn_dim", "max_seq_len") if getattr(m, name) < 1]
    problems += [f"model.{name}={getattr(m, name)} must be > 0"
                 for name in ("rope_theta", "norm_eps", "init_std") if getattr(m, name) <= 0]
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
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    # context parallel (plait/parallel/context.py): "ring" (Liu et al. 2023) or "allgather"
    # K/V (Llama 3); "zigzag" (rank i: chunks i and 2cp-1-i of 2cp) or "contiguous" slices
    cp_mode: str = "ring"
    cp_layout: str = "zigzag"
    schedule: str = "1f1b"
    # Pipeline stages per rank; None: the schedule's own (its registry entry: 2 for
    # interleaved and the V schedules zb-v / dualpipev, else 1).
    virtual_stages: int | None = None
    # Micro-batches per step per data-parallel replica. None: derived from
    # train.micro_batch_size, or 1 (pp for pipelines) when neither is given.
    microbatches: int | None = None
    data_parallel: str = "bucketed"  # "naive" | "bucketed"
    bucket_mb: float = 25.0
    order: tuple[str, ...] = DEFAULT_ORDER
    gpus_per_node: int = 8

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


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
    # "adamw" | "sgd": plain SGD (no momentum, no weight decay) is scale-sensitive, the
    # parity check that a gradient off by a constant factor cannot pass (docs/parity.md)
    optimizer: str = "adamw"
    precision: str = "fp32"  # "fp32" | "bf16" (bf16 compute, fp32 master weights)
    recompute: str = "none"  # "none" | "full" (per block)
    seed: int = 1234
    data: str | None = None  # token file (.bin with .json beside it); None: default corpus
    memory_step: int = -1  # measure memory by category during this step (-1: never)
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
                    for name in ("dp", "tp", "pp", "cp", "ep") if getattr(p, name) < 1]
        problems += _model_range_problems(self.model)
        if problems:  # every later check divides by these sizes
            return problems
        return (self._parallel_problems(world_size) + self._model_problems()
                + self._tensor_parallel_problems() + self._context_parallel_problems()
                + self._pipeline_problems()
                + self._unbuilt_problems() + self._batch_problems() + self._train_problems())

    def _parallel_problems(self, world_size: int | None) -> list[str]:
        """The layout against the world, and the parallel settings' own ranges."""
        p = self.parallel
        checks = [
            (world_size is not None and p.world_size != world_size,
             f"layout dp*pp*cp*tp = {p.dp}*{p.pp}*{p.cp}*{p.tp} = {p.world_size} does not "
             f"match the world size {world_size}; change the layout or launch "
             f"{p.world_size} ranks (--nproc {p.world_size})"),
            (sorted(p.order) != sorted(DIMS),
             f"parallel.order={','.join(p.order)} must name each of {', '.join(DIMS)} once"),
            (p.zero not in (0, 1, 2, 3),
             f"parallel.zero={p.zero} is not a ZeRO stage; use 0, 1, 2 or 3"),
            (p.data_parallel not in ("naive", "bucketed"),
             f"parallel.data_parallel={p.data_parallel!r}; use 'naive' or 'bucketed'"),
            (p.bucket_mb <= 0, f"parallel.bucket_mb={p.bucket_mb} must be > 0"),
            (p.schedule not in SCHEDULES,
             f"parallel.schedule={p.schedule!r}; use one of {', '.join(SCHEDULE_NAMES)}"),
            (p.gpus_per_node < 1, f"parallel.gpus_per_node={p.gpus_per_node} must be >= 1"),
            (p.virtual_stages is not None and p.virtual_stages < 1,
             f"parallel.virtual_stages={p.virtual_stages} must be >= 1 (leave it out for "
             "the schedule's own)"),
        ]
        return [problem for broken, problem in checks if broken]

    def _model_problems(self) -> list[str]:
        """The model's own shape: heads, head dim."""
        problems: list[str] = []
        m = self.model
        if m.n_heads % m.n_kv_heads:
            problems.append(
                f"model.n_kv_heads={m.n_kv_heads} does not divide n_heads={m.n_heads}; use one "
                f"of {_divisors(m.n_heads)}"
            )
        if m.dim % m.n_heads:
            problems.append(f"model.dim={m.dim} is not a multiple of n_heads={m.n_heads}")
        elif (m.dim // m.n_heads) % 2:
            problems.append(f"head dim {m.dim // m.n_heads} must be even for RoPE")
        return problems

    def _tensor_parallel_problems(self) -> list[str]:
        """Shapes tp must divide (plait/parallel/tensor.py), and sequence parallel."""
        problems: list[str] = []
        m, p, t = self.model, self.parallel, self.train
        if p.tp > 1:
            for what, n in (("n_heads", m.n_heads), ("dim", m.dim), ("ffn_dim", m.ffn_dim)):
                if n % p.tp:
                    problems.append(
                        f"tp={p.tp} does not divide model.{what}={n}; use tp in {_divisors(n)}")
            if m.n_kv_heads % p.tp and p.tp % m.n_kv_heads:
                problems.append(
                    f"tp={p.tp} and model.n_kv_heads={m.n_kv_heads}: KV heads are split when "
                    f"tp divides them and replicated when they divide tp; use tp in "
                    f"{_divisors(m.n_kv_heads)} or a multiple of {m.n_kv_heads}")
        if p.sp and p.tp == 1:
            problems.append("parallel.sp=true splits the sequence over tp, but tp=1; set "
                            "--tp > 1 or drop --sp")
        elif p.sp and t.seq_len % p.tp:
            problems.append(
                f"sequence parallel splits train.seq_len={t.seq_len} over tp={p.tp}; use a "
                f"seq_len that is a multiple of {p.tp} (e.g. {t.seq_len - t.seq_len % p.tp})")
        return problems

    def _context_parallel_problems(self) -> list[str]:
        """The cp mode and layout, and the sequence cp (and SP within it) must split."""
        p, t = self.parallel, self.train
        chunks = 2 * p.cp if p.cp_layout == "zigzag" else p.cp
        checks = [
            (p.cp_mode not in ("ring", "allgather"),
             f"parallel.cp_mode={p.cp_mode!r}; use 'ring' or 'allgather'"),
            (p.cp_layout not in ("zigzag", "contiguous"),
             f"parallel.cp_layout={p.cp_layout!r}; use 'zigzag' or 'contiguous'"),
            (p.cp > 1 and t.seq_len % chunks,
             f"cp={p.cp} ({p.cp_layout}) cuts train.seq_len={t.seq_len} into {chunks} equal "
             f"chunks; use a seq_len that is a multiple of {chunks} (e.g. "
             f"{max(t.seq_len - t.seq_len % chunks, chunks)})"),
            (p.cp > 1 and p.sp and t.seq_len % chunks == 0 and (t.seq_len // p.cp) % p.tp,
             f"sequence parallel splits each cp rank's {t.seq_len // max(p.cp, 1)} tokens over "
             f"tp={p.tp}; use a seq_len that is a multiple of {chunks * p.tp}"),
        ]
        return [problem for broken, problem in checks if broken]

    def _pipeline_problems(self) -> list[str]:
        """For pp > 1: the schedule's requests (the registry's rules), the layer split, and
        the combinations not built with a pipeline."""
        m, p, t = self.model, self.parallel, self.train
        if p.pp > m.n_layers:
            return [f"pp={p.pp} is more stages than model.n_layers={m.n_layers}; use "
                    f"pp <= {m.n_layers}"]
        if p.pp == 1 or p.schedule not in SCHEDULES:
            return []
        spec = SCHEDULES[p.schedule]
        v = natural_virtual_stages(p.schedule, p.virtual_stages)
        problems = validate_schedule_request(p.schedule, p.pp, self.microbatches(), v,
                                             n_layers=m.n_layers)
        if spec.chains > 1 and p.zero:
            problems.append(f"zero={p.zero} with schedule {p.schedule} (two model copies "
                            "whose gradients are summed) is not supported yet; use zero=0 or "
                            "schedule dualpipev")
        if m.tie_embeddings:
            problems.append("model.tie_embeddings=true with pp>1: the embedding and the head "
                            "sit on different stages; set model.tie_embeddings=false")
        if t.recompute != "none" and spec.split_backward:
            whole_b = " / ".join(n for n, s in SCHEDULES.items() if not s.split_backward)
            problems.append(f"train.recompute={t.recompute} with schedule {p.schedule} (I/W "
                            "split) is not supported; use train.recompute=none or schedule "
                            f"{whole_b}")
        return problems

    def _unbuilt_problems(self) -> list[str]:
        """Strategies and combinations not built yet: refused, never silently ignored."""
        problems: list[str] = []
        m, p = self.model, self.parallel
        if m.n_experts:
            problems.append(f"model has {m.n_experts} experts: MoE blocks are not built yet; "
                            "use a dense model (n_experts=0)")
        if p.ep > 1:
            problems.append(f"parallel.ep={p.ep}: ep is not implemented in this build yet; "
                            "use ep=1 (data parallel is available)")
        if p.zero > 0 and m.tie_embeddings:
            problems.append("ZeRO shards each parameter within one module: set "
                            "model.tie_embeddings=false, or zero=0")
        if p.zero >= 2 and p.pp > 1:
            problems.append(f"zero={p.zero} with pp={p.pp}: pipeline stages accumulate "
                            "gradients across micro-batches; use zero=0 or 1 with pp")
        return problems

    def _batch_problems(self) -> list[str]:
        """Batch arithmetic: the global batch is set once, everything else derives from it."""
        p, t = self.parallel, self.train
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
                f"{_divisors(per_replica)}"
            )
        if t.micro_batch_size is None:
            return problems
        if t.micro_batch_size < 1 or per_replica % t.micro_batch_size:
            problems.append(
                f"train.micro_batch_size={t.micro_batch_size} does not divide the "
                f"{per_replica} sequences per replica; use one of {_divisors(per_replica)}"
            )
        elif p.microbatches is not None and p.microbatches * t.micro_batch_size != per_replica:
            problems.append(
                f"parallel.microbatches={p.microbatches} and train.micro_batch_size="
                f"{t.micro_batch_size} disagree ({per_replica} sequences per replica); "
                "set only one of them"
            )
        return problems

    def _train_problems(self) -> list[str]:
        """The training settings' own ranges (sequence, steps, precision, optimizer, LR)."""
        m, t = self.model, self.train
        checks = [
            (t.seq_len < 1, f"train.seq_len={t.seq_len} must be >= 1"),
            (t.seq_len >= 1 and t.seq_len > m.max_seq_len,
             f"train.seq_len={t.seq_len} is longer than the model's max_seq_len="
             f"{m.max_seq_len}; use --seq-len {m.max_seq_len} or less, or raise "
             "model.max_seq_len"),
            (t.steps < 1, f"train.steps={t.steps} must be >= 1"),
            (t.precision not in ("fp32", "bf16"),
             f"train.precision={t.precision!r}; use 'fp32' or 'bf16'"),
            (t.recompute not in ("none", "full"),
             f"train.recompute={t.recompute!r}; use 'none' or 'full'"),
            (t.lr <= 0, f"train.lr={t.lr} must be > 0"),
            (t.grad_clip < 0,
             f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)"),
            (t.optimizer not in ("adamw", "sgd"),
             f"train.optimizer={t.optimizer!r}; use 'adamw' or 'sgd'"),
            (t.optimizer == "sgd" and bool(t.weight_decay),
             f"train.optimizer='sgd' has no weight decay; set train.weight_decay=0 (it is "
             f"{t.weight_decay})"),
            (not 0 <= t.min_lr_ratio <= 1,
             f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]"),
            (t.warmup_steps < 0, f"train.warmup_steps={t.warmup_steps} must be >= 0"),
            (t.weight_decay < 0, f"train.weight_decay={t.weight_decay} must be >= 0"),
            (not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1),
             f"train.beta1={t.beta1} and train.beta2={t.beta2} must be in [0, 1)"),
            (t.eps <= 0, f"train.eps={t.eps} must be > 0"),
            (t.memory_step < -1 or t.memory_step >= t.steps,
             f"train.memory_step={t.memory_step} is not a step of this run; use 0 to "
             f"{t.steps - 1}, or -1 for none"),
        ]
        return [problem for broken, problem in checks if broken]

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
        if p.tp > p.gpus_per_node:
            notes.append(
                f"tp={p.tp} is larger than gpus_per_node={p.gpus_per_node}: tensor-parallel "
                "all-reduces cross nodes every layer (Stanford CS336 lecture 8 reports a 42% "
                f"throughput drop going from 8 to 16 GPUs); keep tp <= {p.gpus_per_node}")
        return notes

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
    overridden), and `[parallel]`, `[train]` tables.
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
    return cfg
