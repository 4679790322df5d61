"""Goodput under failures: the checkpoint interval and the share of wall time that trains.

A job of n GPUs fails at rate 1/M (M the job's mean time between failures: the per-GPU
MTBF / n when failures are independent, or given per job). Each checkpoint takes C
seconds (the most loaded writer's bytes over its write bandwidth, or all the bytes over
the filesystem's, the slower), a failure costs the work since the last checkpoint and a
restart of R seconds (detect, relaunch, reload). Training runs in segments of tau seconds
of work, each followed by a checkpoint.

- Interval: tau = sqrt(2 C M) (Young 1974, "A first order approximation to the optimum
  checkpoint interval", CACM 17(9)); Daly's higher-order optimum (Daly 2006, "A higher
  order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3)) is
  reported beside it.
- Expected wall time of one segment with exponential failures, failures during the
  checkpoint and the restart included: M e^(R/M) (e^((tau + C)/M) - 1) (Daly 2006's
  complete model), so goodput = tau / (M e^(R/M) (e^((tau + C)/M) - 1)).
  tests/test_plan_goodput.py checks it against a seeded failure-injection simulation.

The checkpoint is what plait saves (docs/checkpoint.md): the fp32 master and the
optimizer's moments of every parameter, each element written once, each rank writing what
it holds (ZeRO >= 1: its shard; replicas: the first holder). The interval is rounded to
whole steps. Reference point: Llama 3 405B saw 419 unexpected interruptions in 54 days on
about 16K GPUs (Dubey et al. 2024, section 3.3.4): a job MTBF of 3.1 h.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.plan import memory
from plait.plan.estimate import Estimate, Training
from plait.plan.hardware import GB
from plait.plan.shape import Shape

Num = Any
HOUR = 3600.0
MTBF_SCOPES = ("gpu", "job")
RANK_BY = ("throughput", "goodput")
DEFAULT_RESTART_MINUTES = 10.0  # declared, not measured: detection + relaunch + reload


@dataclass(frozen=True)
class Failures:
    mtbf_hours: float
    per: str = "gpu"  # "gpu": each GPU's MTBF (the job's is / n); "job": the job's
    write_gbs: float = 1.0  # checkpoint write bandwidth of one writing rank, GB/s
    fs_gbs: float | None = None  # the filesystem's aggregate write bandwidth, GB/s
    restart_minutes: float = DEFAULT_RESTART_MINUTES

    def job_mtbf_s(self, n_gpus: int) -> float:
        m = self.mtbf_hours * HOUR
        return m / n_gpus if self.per == "gpu" else m


def young_interval(c: Num, m: Num) -> Num:
    """Young 1974: tau = sqrt(2 C M)."""
    return np.sqrt(2 * np.asarray(c, dtype=float) * m)


def daly_interval(c: float, m: float) -> float:
    """Daly 2006: sqrt(2CM) (1 + sqrt(C/2M)/3 + C/(18M)) - C for C < 2M, else M."""
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def goodput(tau: Num, c: Num, m: float, r: float) -> Num:
    """Useful share of wall time: tau / (M e^(R/M) (e^((tau + C)/M) - 1)) (Daly 2006)."""
    tau = np.asarray(tau, dtype=float)
    return tau / (m * math.exp(r / m) * np.expm1((tau + c) / m))


def checkpoint_bytes(est: Estimate, shape: Shape, train: Training) -> tuple[Num, float]:
    """(bytes the most loaded writer writes, bytes of the whole checkpoint)."""
    pb, _, kb = memory.state_bytes(train.precision, train.optimizer)
    per_param = kb + (pb if train.precision == "fp32" else 0)  # fp32: the param is the master
    lay = est.layout
    rank = np.asarray(est.extra["rank_params"], dtype=float)
    experts = np.asarray(est.extra["rank_expert_params"], dtype=float)
    if lay.zero >= 1:
        # ZeRO shards the dense states over the replicas (hybrid sharding: one shard
        # group of them; a copy's first holder writes it), the routed experts' over the
        # replicas that hold the same experts
        dshard = np.asarray(lay.zero_split, dtype=float)
        rank = (rank - experts) / dshard + experts / (dshard / np.asarray(lay.expert_split,
                                                                          dtype=float))
    return rank * per_param, float(shape.num_params() * per_param)


def layout_goodput(est: Estimate, shape: Shape, train: Training, n_gpus: int,
                   f: Failures) -> dict[str, Num]:
    """Checkpoint size and time, interval (seconds and steps), goodput, effective tokens/s
    of one layout (or of arrays of layouts in a search)."""
    rank_bytes, total = checkpoint_bytes(est, shape, train)
    c = rank_bytes / (f.write_gbs * GB)
    if f.fs_gbs:
        c = np.maximum(c, total / (f.fs_gbs * GB))
    m, r = f.job_mtbf_s(n_gpus), f.restart_minutes * 60
    step = np.asarray(est.step_time, dtype=float)
    steps = np.maximum(1.0, np.round(young_interval(c, m) / step))
    g = goodput(steps * step, c, m, r)
    return {"job_mtbf_s": m, "checkpoint_bytes_per_rank": rank_bytes,
            "checkpoint_bytes_total": total, "checkpoint_s": c, "restart_s": r,
            "interval_s": steps * step, "interval_steps": steps, "goodput": g,
            "effective_tokens_per_s": est.tokens_per_s * g,
            "seconds_per_useful_step": step / g}


def goodput_dict(gp: dict[str, Num], c: float, m: float) -> dict[str, Any]:
    out = {k: float(np.asarray(v)) for k, v in gp.items()}
    out["interval_steps"] = int(out["interval_steps"])
    out["young_interval_s"] = float(young_interval(c, m))
    out["daly_interval_s"] = daly_interval(c, m)
    return out


def goodput_lines(gp: dict[str, Any]) -> list[str]:
    return [f"Goodput: job MTBF {gp['job_mtbf_s'] / HOUR:.2f} h; checkpoint "
            f"{gp['checkpoint_bytes_total'] / GB:,.0f} GB in all, "
            f"{gp['checkpoint_bytes_per_rank'] / GB:.2f} GB on the most loaded writer, "
            f"{gp['checkpoint_s']:.1f} s to write; interval sqrt(2 C MTBF) = "
            f"{gp['young_interval_s']:.0f} s (Young 1974; Daly 2006: "
            f"{gp['daly_interval_s']:.0f} s) = every {gp['interval_steps']} steps; restart "
            f"{gp['restart_s']:.0f} s; expected goodput {gp['goodput']:.1%}, "
            f"{gp['effective_tokens_per_s']:,.0f} useful tokens/s."]


def add_goodput_arguments(p: Any) -> None:
    g = p.add_argument_group("goodput under failures (Young 1974, Daly 2006)")
    g.add_argument("--mtbf-hours", type=float, metavar="H",
                   help="mean time between failures, hours (per GPU by default; Llama 3 405B: "
                   "419 interruptions in 54 days on ~16K GPUs, i.e. 3.1 h per job)")
    g.add_argument("--mtbf-per", choices=MTBF_SCOPES, default="gpu",
                   help="--mtbf-hours is each GPU's (the job's is / GPUs) or the job's "
                   "(default gpu)")
    g.add_argument("--ckpt-write-gbs", type=float, metavar="GB/S",
                   help="checkpoint write bandwidth of one writing rank, GB/s (needed with "
                   "--mtbf-hours)")
    g.add_argument("--ckpt-fs-gbs", type=float, metavar="GB/S",
                   help="the filesystem's aggregate write bandwidth, GB/s (default: no limit)")
    g.add_argument("--restart-minutes", type=float, default=DEFAULT_RESTART_MINUTES,
                   metavar="MIN", help="detect + relaunch + reload after a failure (default "
                   f"{DEFAULT_RESTART_MINUTES:g}, declared)")
    g.add_argument("--rank-by", choices=RANK_BY, default="throughput",
                   help="order layouts by tokens/s, or by useful tokens/s under failures "
                   "(needs --mtbf-hours; default throughput)")


def goodput_flag_problems(args: Any) -> list[str]:
    out = []
    for flag in ("mtbf-hours", "ckpt-write-gbs", "ckpt-fs-gbs"):
        v = getattr(args, flag.replace("-", "_"), None)
        if v is not None and (not math.isfinite(v) or v <= 0):
            out.append(f"--{flag} {v} must be a finite number > 0")
    r = args.restart_minutes
    if not math.isfinite(r) or r < 0:
        out.append(f"--restart-minutes {r} must be a finite number >= 0")
    if args.mtbf_hours is None:
        if args.rank_by == "goodput":
            out.append("--rank-by goodput needs --mtbf-hours (and --ckpt-write-gbs)")
        if args.ckpt_write_gbs is not None or args.ckpt_fs_gbs is not None:
            out.append("--ckpt-write-gbs / --ckpt-fs-gbs are for goodput: give --mtbf-hours "
                       "too, or leave them out")
    elif args.ckpt_write_gbs is None:
        out.append("--mtbf-hours needs --ckpt-write-gbs (the checkpoint write bandwidth of "
                   "one rank, GB/s) to size the checkpoint time")
    return out


def failures_from_args(args: Any) -> Failures | None:
    if args.mtbf_hours is None:
        return None
    return Failures(args.mtbf_hours, args.mtbf_per, args.ckpt_write_gbs, args.ckpt_fs_gbs,
                    args.restart_minutes)


def layouts_goodput(ests: list[Estimate], shape: Shape, train: Training, n_gpus: int,
                    f: Failures) -> list[dict[str, Any]]:
    """`goodput_dict` of each shown layout."""
    out = []
    for e in ests:
        gp = layout_goodput(e, shape, train, n_gpus, f)
        out.append(goodput_dict(gp, float(gp["checkpoint_s"]), gp["job_mtbf_s"]))
    return out
