"""The training flags, shared by `plait train`, the rank entry `python -m plait.train`
(what torchrun runs) and `plait report`: one table from flag to configuration key, and
the data file a configuration trains on. Below the CLI so that every command that takes
train flags reads them from here, not from the `plait` command's module.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from plait.checkpoint.cli import add_checkpoint_args
from plait.config import Config, ConfigError, load_config
from plait.config.checks import ZERO3_GATHERS
from plait.config.muon_checks import MUON_NS_DTYPES, MUON_SCALES
from plait.device import CHOICES as DEVICE_CHOICES
from plait.dims import DIMENSIONS, DIMS, LAID
from plait.model.presets import PRESETS
from plait.schedule.registry import SCHEDULE_NAMES
from plait.train.sinks import add_sink_args

# flag -> config key (None value = flag not given)
TRAIN_FLAGS = {
    "model": "model_name", "steps": "train.steps", "seed": "train.seed",
    "global_batch": "train.global_batch", "seq_len": "train.seq_len",
    "micro_batch_size": "train.micro_batch_size", "lr": "train.lr",
    "precision": "train.precision", "fp8_recipe": "train.fp8_recipe",
    "recompute": "train.recompute", "data": "train.data",
    "zero": "parallel.zero", "schedule": "parallel.schedule",
    "microbatches": "parallel.microbatches", "virtual_stages": "parallel.virtual_stages",
    "data_parallel": "parallel.data_parallel", "gpus_per_node": "parallel.gpus_per_node",
    "sp": "parallel.sp", "async_tp": "parallel.async_tp", "compile": "train.compile",
    "overlap_fb": "parallel.overlap_fb",
    "init_from": "train.init_from", "documents": "train.documents",
    "optimizer_sync": "parallel.optimizer_sync", "dp_shard": "parallel.dp_shard",
    "zero3_gather": "parallel.zero3_gather", "fault_tolerance": "parallel.fault_tolerance",
    "replica_timeout": "parallel.replica_timeout_s", "min_replicas": "parallel.min_replicas",
    "eval_every": "train.eval_every", "eval_data": "train.eval_data",
    "optimizer": "train.optimizer", "muon_scale": "train.muon_scale",
    "muon_ns_dtype": "train.muon_ns_dtype",
    # each parallel dimension's size and its own settings (plait/dims/)
    **{d.name: d.field for d in DIMENSIONS},
    **{s.key: f"parallel.{s.key}" for d in DIMENSIONS for s in d.settings},
}


def _data_dir_help() -> str:
    from plait.train.corpus import default_data_dir

    home = str(Path.home())
    shown = str(default_data_dir())
    return ("where the default corpus lives (default "
            f"{'~' + shown[len(home):] if shown.startswith(home) else shown})")


DATA_DIR_HELP = _data_dir_help()  # `plait demo` and `plait data prepare` say the same


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The flags that build the configuration and name its data (what `plait report`
    takes beside a metrics file)."""
    p.add_argument("--config", help="TOML file with [model], [parallel], [train] tables")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any setting, e.g. --set train.warmup_steps=5")
    p.add_argument("--model", metavar="PRESET", help=f"model preset: {', '.join(PRESETS)} "
                   f"(model_name, default {Config().model_name})")
    p.add_argument("--data", help="token file (.bin); default: the embedded corpus")
    p.add_argument("--data-dir", help=DATA_DIR_HELP)
    for name in ("steps", "seed", "global-batch", "seq-len", "micro-batch-size",
                 *DIMS, *(d.name.replace("_", "-") for d in LAID), "dp-shard", "zero",
                 "microbatches",
                 "virtual-stages", "gpus-per-node"):
        p.add_argument(f"--{name}", type=int, metavar="N", help=_setting_help(name))
    p.add_argument("--lr", type=float, help=_setting_help("lr"))
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, help=_setting_help("schedule"))
    p.add_argument("--precision", choices=("fp32", "bf16", "fp8", "fp64"),
                   help=_setting_help("precision"))
    p.add_argument("--fp8-recipe", choices=("tensorwise", "blockwise"),
                   help=_setting_help("fp8-recipe"))
    p.add_argument("--recompute", choices=("none", "selective", "full"),
                   help=_setting_help("recompute"))
    p.add_argument("--data-parallel", choices=("naive", "bucketed"),
                   help=_setting_help("data-parallel"))
    p.add_argument("--optimizer", choices=("adamw", "sgd", "muon"),
                   help=_setting_help("optimizer"))
    p.add_argument("--muon-scale", choices=MUON_SCALES, help=_setting_help("muon-scale"))
    p.add_argument("--muon-ns-dtype", choices=MUON_NS_DTYPES,
                   help=_setting_help("muon-ns-dtype"))
    p.add_argument("--optimizer-sync", choices=("barrier", "post_validation"),
                   help=_setting_help("optimizer-sync"))
    p.add_argument("--zero3-gather", choices=ZERO3_GATHERS, help=_setting_help("zero3-gather"))
    for setting in (s for d in DIMENSIONS for s in d.settings):
        if setting.choices:
            p.add_argument(setting.flag, choices=setting.choices, help=setting.help)
        else:  # an integer
            p.add_argument(setting.flag, type=int, metavar="N", help=setting.help)
    p.add_argument("--sp", action="store_true", default=None,
                   help="sequence parallel: split norms and residual over tp")
    p.add_argument("--async-tp", action="store_true", default=None,
                   help="async tensor parallel (with --sp): each all-gather and "
                   "reduce-scatter of tp runs as ring hops overlapped with the matmuls beside "
                   "them; the same bytes (parallel.async_tp; docs/async_tp.md)")
    p.add_argument("--overlap-fb", action="store_true", default=None,
                   help="dualpipe/dualpipev: run each F&B pair interleaved, one micro-batch's "
                   "expert all-to-alls in flight under the other's compute "
                   "(parallel.overlap_fb; docs/pipeline_runtime.md)")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile each transformer block (inductor; "
                   "train.compile_backend), collectives left eager between the compiled "
                   "graphs (train.compile; docs/compile.md)")
    p.add_argument("--documents", action="store_true", default=None,
                   help="packed documents: attention causal within each document of a "
                   "window and never across one, positions restarting per document, no "
                   "loss across a boundary (train.documents; docs/context_parallel.md)")
    p.add_argument("--fault-tolerance", action="store_true", default=None,
                   help="each dp_replicate group is a unit of failure: when one dies or "
                   "stops answering the others finish the step without it and go on, and a "
                   "replacement joins from a live replica (parallel.fault_tolerance; "
                   "docs/fault_tolerance.md)")
    p.add_argument("--replica-timeout", type=float, metavar="S",
                   help=_setting_help("replica-timeout"))
    p.add_argument("--min-replicas", type=int, metavar="N", help=_setting_help("min-replicas"))
    p.add_argument("--init-from", metavar="hf:DIR|dcp:DIR|CHECKPOINT",
                   help=_setting_help("init-from") + "; the model is the source's, or the "
                   "run's for a DCP checkpoint that records none (docs/interop.md)")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The configuration flags and a run's own: outputs, timeout, output level, device."""
    add_config_args(p)
    p.add_argument("--metrics-out", help="JSON lines: one per step, then a summary (streamed "
                   "to NAME.partial, renamed to NAME when the run completes)")
    p.add_argument("--trace", metavar="FILE.json", help="Chrome trace (open in Perfetto) of "
                   "the last step on every rank, any layout: the pipeline actions, each "
                   "unit's forward/backward, the optimizer, and each collective with its dim, "
                   "bytes and blocked (exposed) part (docs/metrics.md)")
    p.add_argument("--timeline", metavar="FILE.png", help="PNG of the same timeline: per rank "
                   "a step row, a units row and a comm row (collective in flight pale, rank "
                   "blocked solid); needs matplotlib")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the job fails with a hang "
                   "report naming the rank behind (default 300; plait/launch/watchdog.py)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar or summary table; the final line is still printed")
    p.add_argument("--debug", action="store_true",
                   help="show Python tracebacks (by default an error is one line)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where each rank computes: cuda:LOCAL_RANK with NCCL, or the CPU with "
                   "gloo; auto (default) takes CUDA when torch sees a GPU")
    p.add_argument("--log-every", type=int, metavar="N",
                   help="print a step line every N steps, and the last (default: about ten "
                   "a run, steps / 10)")
    p.add_argument("--eval-every", type=int, metavar="N", help=_setting_help("eval-every")
                   + "; val_loss and val_perplexity in that step's row (docs/metrics.md)")
    p.add_argument("--eval-data", metavar="FILE.bin", help=_setting_help("eval-data"))
    add_sink_args(p)  # --tensorboard, --wandb (plait/train/sinks.py)
    add_checkpoint_args(p)
    p.add_argument("--checkpoint-on-stop", action="store_true",
                   help="on SIGINT/SIGTERM/SIGHUP, finish the current step and save a final "
                   "checkpoint in --checkpoint-dir (every rank at the same step) before "
                   "exiting 128 + the signal; default off: stop at once, saving nothing")


# what each setting flag sets, for its help line
_SETTING_HELP = {
    "steps": "optimizer steps", "seed": "seed of the weights and the data order",
    "global-batch": "sequences per optimizer step, over all replicas",
    "seq-len": "tokens per sequence", "micro-batch-size": "sequences per micro-batch per "
    "replica (or give --microbatches)",
    **{d.name.replace("_", "-"): d.help for d in DIMENSIONS},
    "dp-shard": "hybrid sharding: ranks ZeRO shards over, dp = dp_shard x dp_replicate "
    "(0: dp / dp_replicate)",
    "zero": "ZeRO stage 0-3", "microbatches": "micro-batches per step per replica",
    "virtual-stages": "pipeline stages per rank", "gpus-per-node": "ranks per node",
    "lr": "peak learning rate", "schedule": "pipeline schedule", "precision": "compute "
    "dtype (fp32 masters either way); fp8: bf16 with the blocks' linears in float8 "
    "(train.fp8_compute); fp64: everything in float64, the parity oracle's precision",
    "fp8-recipe": "--precision fp8's scaling: tensorwise (one scale a tensor) or "
    "blockwise (DeepSeek-V3's 1 x B activation tiles and B x B weight blocks, "
    "B = train.fp8_block, default 128)",
    "recompute": "activation recompute per block: "
    "none, selective (saves matmul outputs; train.recompute_ops) or full",
    "data-parallel": "gradient all-reduce: one per gradient, or bucketed and overlapped",
    "init-from": "starting weights: a Hugging Face directory hf:DIR, a DCP checkpoint "
    "with torchtitan's names dcp:DIR, or a plait checkpoint",
    "optimizer": "the update: AdamW, plain SGD (no momentum, no decay), or Muon on the "
    "hidden matrices with AdamW for the rest (docs/muon.md)",
    "muon-scale": "Muon's update factor: moonlight (0.2 sqrt(max(A, B)), AdamW's RMS) or "
    "original (sqrt(max(1, A/B)))",
    "muon-ns-dtype": "the dtype of Muon's Newton-Schulz iteration (bf16 as published; fp32 or "
    "fp64 for parity)",
    "optimizer-sync": "pipelines: update after one global grad-norm check, or each stage "
    "at once, validated and rolled back on failure (docs/pipeline_runtime.md)",
    "min-replicas": "--fault-tolerance: with fewer live replicas, a step waits for "
    "replacements to join",
    "replica-timeout": "--fault-tolerance: seconds a replica may keep the others waiting "
    "before it is left out",
    "eval-every": "validation loss every N steps and after the last, forward only",
    "eval-data": "held-out token file the validation loss is computed on (same format as "
    "--data; its first train.eval_sequences windows, in file order)",
    "zero3-gather": "ZeRO-3: gather a unit around each forward and backward, or once a "
    "step and keep it to its stage's last backward (more memory, fewer bytes; docs/zero.md)",
}


def _setting_help(flag: str) -> str:
    """'<what> (config KEY, default VALUE)': the default is the configuration's."""
    key = TRAIN_FLAGS[flag.replace("-", "_")]
    section, _, name = key.partition(".")
    default = getattr(getattr(Config(), section), name)
    shown = "the schedule's own" if default is None and name == "virtual_stages" else (
        "the name-seeded init" if name == "init_from" else
        "none" if default is None and name in ("eval_every", "eval_data") else
        "derived" if default is None else default)
    return f"{_SETTING_HELP[flag]} ({key}, default {shown})"


def config_from_args(args: argparse.Namespace) -> Config:
    """Defaults, the TOML file, then (with train.init_from) the source's model, then the
    flags, then `--set`."""
    overrides = {key: getattr(args, flag, None) for flag, key in TRAIN_FLAGS.items()}
    cfg = load_config(args.config, overrides=overrides, sets=args.set)
    if cfg.train.init_from is None:
        return cfg
    from plait.checkpoint.format import CheckpointError
    from plait.checkpoint.init_from import initial_model

    try:
        model = initial_model(cfg.train.init_from)
    except CheckpointError as e:
        raise ConfigError([f"--init-from: {e}"]) from None
    if model is None:  # a DCP checkpoint without plait's record: the run's own model
        return cfg
    if overrides["model_name"] is not None:
        raise ConfigError([f"--model {overrides['model_name']} and --init-from both name the "
                           "model; give one of them"])
    base = {f"model.{k}": v for k, v in dataclasses.asdict(model).items()}
    return load_config(args.config, overrides={**base, **overrides}, sets=args.set)


def resolve_data(cfg: Config, data_dir: str | None) -> Path:
    """The token file to train on; the default corpus is prepared on first use."""
    from plait.train.corpus import default_token_file, prepare

    if cfg.train.data:
        return Path(cfg.train.data)
    path = default_token_file(Path(data_dir) if data_dir else None)
    if not path.is_file() or not path.with_suffix(".json").is_file():
        print(f"plait: preparing the default corpus in {path.parent} (once)...", flush=True)
        prepare(path)
    return path


def check_data(cfg: Config, path: Path) -> None:
    from plait.train.data import GlobalBatches, TokenFile

    batches = GlobalBatches(TokenFile.open(path), cfg.train.seq_len, cfg.train.global_batch,
                            cfg.train.seed, cfg.model.vocab_size)
    if cfg.train.documents:  # the boundaries are there (DataError naming the fix if not)
        batches.end_of_document()
