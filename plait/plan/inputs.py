"""Every `plait plan` flag checked for range and finiteness before any search starts, and
`--layout` (with `--order`) read into a `Layout`.

The limits are what the planner enumerates in seconds (divisors by trial division to
sqrt(n), micro-batch sizes up to 16, pipelines simulated or extrapolated); past them a
request is refused at once with the limit named, never left to run for minutes.
"""

from __future__ import annotations

import argparse
import math

from plait.dims import DEFAULT_ORDER, LAID
from plait.plan.basis import ALWAYS_WRITTEN, WRITTEN, Layout
from plait.plan.search import PlanError
from plait.schedule.registry import schedule_spec

MAX_GPUS = 1 << 24  # 16,777,216
MAX_GLOBAL_BATCH = 1 << 24  # sequences per step
MAX_GLOBAL_BATCH_TOKENS = 1 << 40
MAX_TOP = 100
# (flag, smallest, largest) for the integer model shapes
SHAPE_BOUNDS = (("layers", 1, 10_000), ("hidden", 1, 1 << 20), ("heads", 1, 1 << 14),
                ("kv-heads", 1, 1 << 14), ("ffn", 1, 1 << 22), ("vocab", 1, 1 << 26),
                ("seq", 1, 1 << 24), ("experts", 0, 1 << 16), ("top-k", 0, 1 << 16),
                ("expert-ffn", 0, 1 << 22), ("shared-experts", 0, 1 << 16),
                ("dense-layers", 0, 10_000))
POSITIVE_FLOATS = ("peak-tflops", "hbm-gb", "hbm-bw-gbs", "nvlink-gbs", "internode-gbs")


def _attr(flag: str) -> str:
    return flag.replace("-", "_")


def _int_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    bounds = [*SHAPE_BOUNDS, ("gpus", 1, MAX_GPUS), ("global-batch", 1, MAX_GLOBAL_BATCH),
              ("global-batch-tokens", 1, MAX_GLOBAL_BATCH_TOKENS), ("gpus-per-node", 1, 1024),
              ("nics-per-node", 1, 1024),
              ("microbatch", 1, MAX_GLOBAL_BATCH), ("microbatches", 1, MAX_GLOBAL_BATCH),
              ("virtual-stages", 1, 64),
              ("top", 1, MAX_TOP)]
    for flag, lo, hi in bounds:
        value = getattr(args, _attr(flag), None)
        if value is None:
            continue
        if value < lo:
            problems.append(f"--{flag} {value} must be >= {lo}")
        elif value > hi:
            problems.append(f"--{flag} {value} is past what the planner enumerates "
                            f"(at most {hi:,}); use a smaller value")
    return problems


def _float_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    for flag in POSITIVE_FLOATS:
        value = getattr(args, _attr(flag), None)
        if value is not None and (not math.isfinite(value) or value <= 0):
            problems.append(f"--{flag} {value} must be a finite number > 0")
    limit = args.mem_limit
    if not math.isfinite(limit) or not 0 < limit <= 1:
        problems.append(f"--mem-limit {limit} is the usable fraction of HBM: use a number in "
                        "(0, 1], e.g. 0.9")
    return problems


def layout_text_problems(text: str | None) -> list[str]:
    """`--layout`: non-empty, each dimension at most once as NAME=N, N >= 1."""
    if text is None:
        return []
    if not text.strip():
        return ["--layout is empty; give e.g. --layout tp=8,pp=4,dp=2, or leave it out to "
                "search every layout"]
    problems, seen = [], set()
    for part in text.split(","):
        name, eq, value = (s.strip() for s in part.partition("="))
        if name not in WRITTEN or not eq or not value.isdigit() or int(value) < 1:
            problems.append(f"--layout item {part.strip()!r}: use NAME=N with NAME one of "
                            f"{', '.join(WRITTEN)} and N >= 1, e.g. tp=8,pp=4,dp=2")
        elif name in seen:
            problems.append(f"--layout gives {name} twice ({text}); give each size once")
        seen.add(name)
    return problems


def plan_flag_problems(args: argparse.Namespace) -> list[str]:
    """Every problem with the flags' values, each with its fix; nothing is computed."""
    return (_int_problems(args) + _float_problems(args) + layout_text_problems(args.layout)
            + _async_tp_problems(args) + output_problems_of(args))


def _async_tp_problems(args: argparse.Namespace) -> list[str]:
    """`--async-tp` decomposes sequence parallel's collectives: it needs them."""
    if getattr(args, "async_tp", False) and getattr(args, "no_sp", False):
        return ["--async-tp overlaps sequence parallel's all-gathers and reduce-scatters, "
                "which --no-sp turns off: drop one of them"]
    return []


def output_problems_of(args: argparse.Namespace) -> list[str]:
    """--plot, --emit-config and the plan beside it: artifacts, so an existing file is
    replaced only with --force; none may be --hardware, the profile read."""
    from plait.files import artifact_problems

    force = getattr(args, "force", False)
    inputs = [h for h in [getattr(args, "hardware", None)] if h]
    out = artifact_problems("--plot", args.plot, inputs, force) if args.plot is not None else []
    emit = getattr(args, "emit_config", None)
    if emit is not None:
        from plait.plan.emit import plan_path

        out += artifact_problems("--emit-config", emit, inputs, force)
        if not out:
            out += artifact_problems("--emit-config (its plan beside it)", plan_path(emit),
                                     inputs, force)
    return out


# plait train's defaults where the planner's differ (plait/config/schema.py): the planner plans
# GPU runs (bf16, ZeRO-1, the model's full context); plait train's suit a CPU test run
TRAIN_DEFAULTS = {"precision": "fp32", "zero": 0, "seq": 64}
PLAN_DEFAULTS = {"precision": "bf16", "zero": 1}


def apply_defaults(args: argparse.Namespace) -> list[str]:
    """Fill the flags left out with the planner's defaults; the ones unlike plait train's,
    said in words (the seq is the preset's, which `shape_from_args` reads)."""
    said = []
    for name, value in PLAN_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
            if name != "zero" or args.layout:  # the search tries every ZeRO stage
                said.append(f"--{name} {value} (plait train's: {TRAIN_DEFAULTS[name]})")
    if getattr(args, "model", None) and getattr(args, "seq", None) is None:
        said.append(f"--seq-len: the preset's max_seq_len (plait train's: "
                    f"{TRAIN_DEFAULTS['seq']})")
    return said


def micro_batch_size(args: argparse.Namespace, dp: int, global_batch: int) -> int:
    """Sequences per micro-batch: --micro-batch-size, or plait train's --microbatches (a
    count per data-parallel replica) converted; 1 when neither is given."""
    count, size = getattr(args, "microbatches", None), args.microbatch
    if count is None:
        return size or 1
    per_replica = global_batch // dp
    if count < 1 or global_batch % dp or per_replica % count:
        raise PlanError(f"--microbatches {count}: the global batch {global_batch} over dp={dp} "
                        f"is {global_batch / dp:g} sequences per replica, not a multiple of "
                        f"{count}; give a count that divides it, or --micro-batch-size")
    if size is not None and size != per_replica // count:
        raise PlanError(f"--microbatches {count} means {per_replica // count} sequences per "
                        f"micro-batch, but --micro-batch-size is {size}; give one of them")
    return per_replica // count


# `--layout`'s sizes the planner writes only where they are not 1, as items
OPTIONAL_SIZES = "".join(f",{name}=N" for name in WRITTEN[len(ALWAYS_WRITTEN):])
DEFAULT_ORDER_TEXT = ",".join(DEFAULT_ORDER)


def _layout_order(args: argparse.Namespace, sizes: dict[str, int]) -> tuple[str, ...]:
    """`--order`: each axis once; a custom one only where no laid dimension is > 1."""
    order = tuple(d.strip() for d in getattr(args, "order", DEFAULT_ORDER_TEXT).split(","))
    if sorted(order) != sorted(DEFAULT_ORDER):
        raise PlanError(f"--order {args.order}: name each of {', '.join(DEFAULT_ORDER)} once, "
                        f"innermost first, e.g. {DEFAULT_ORDER_TEXT}")
    laid = [d.name for d in LAID]
    if order != DEFAULT_ORDER and any(sizes[name] > 1 for name in laid):
        raise PlanError(f"--order {args.order}: a custom order is modelled for dense "
                        f"layouts only; leave out {' and '.join(laid)} or --order")
    return order


def parse_layout(text: str, args: argparse.Namespace, global_batch: int) -> Layout:
    sizes = {name: 1 for name in WRITTEN}
    for part in text.split(","):
        k, _, v = part.partition("=")
        k = k.strip()
        if k not in sizes or not v.strip().isdigit() or int(v) < 1:
            raise PlanError(f"bad layout item {part!r}: use "
                            f"{','.join(f'{n}=N' for n in ALWAYS_WRITTEN)}[{OPTIONAL_SIZES}]")
        sizes[k] = int(v)
    v = args.virtual_stages
    spec = schedule_spec(args.schedule)
    if not spec.free_virtual_stages and spec.virtual_stages > 1:
        v = spec.virtual_stages  # the V schedules fix 2 per rank, whatever the flag says
    order = _layout_order(args, sizes)
    mbs = micro_batch_size(args, sizes["dp"], global_batch)
    return Layout(sizes, mbs=mbs, schedule=args.schedule, v=v, zero=args.zero,
                  recompute=args.recompute, sp=not args.no_sp, attention=args.attention,
                  order=order, async_tp=getattr(args, "async_tp", False),
                  overlap_fb=getattr(args, "overlap_fb", False))
