"""The optimizer step without a barrier: steady-state bubble, barrier vs post-validation.

    python benchmarks/post_validation.py [--pp 2] [--microbatches 4] [--steps 6]
        [--dim 256] [--layers 8] [--seq-len 128] [--schedules zb-h2,zb-v,dualpipev]
        [--repeats 2] [--grad-clip 10] [--write docs/results/post_validation.md]

gloo on CPU, one thread per rank; plait's whole training step (forward, backward, grad
norm, clip, AdamW, the logged loss) through `plait.train.loop.train`. For each schedule
the same run is trained with `parallel.optimizer_sync=barrier` and `=post_validation`,
alternated (`--repeats` times each) so both see the same machine. Printed per run, from
the runtime's records (plait/parallel/pipeline/measure.py, `steady_state`): the steady
step period (one step's last compute to the next one's, mean over the steps after the
first) and its fastest and median step (time-slicing makes single steps slow), the time
between a rank's steps (`between_steps`: update and host work), the overlap, the steady
bubble 1 - busy / (pp x period) (the optimizer, the check and any barrier count as idle)
beside the simulator's steady state over as many steps ("sim": the run's optimizer_sync,
its measured durations and time between steps) and their difference in points; the same
steps simulated with each step's own per-stage means and its own time between steps
("step"), and replayed, each action of each step its own measured duration ("replay";
"m-rep" the measured bubble minus it: what the simulator's rules miss, where "diff" also
holds the spread of the durations); the one-step bubble over the span ("span", which
cannot see one step's forwards overlapping the previous one's end) and its one-step
simulation ("sim1"), the measured p2p latency the simulator adds to each cross-rank
dependency and the runtime's gap it adds before each compute (`runtime_stats.runtime_gap`;
ms), the check's window at each rank's cut (`runtime_stats.check_per_rank`, mean over the
ranks; ms), which the simulator lays out there from the second step (and `runtime_gap`
leaves out); how many steps' prefixes were run again (failed checks: `--grad-clip` above
the norm keeps them at zero, the case post-validation is built for). Last, post-
validation's period over the barrier's (medians over the repeats; measured mean, fastest
step, simulated): below 1 is the bubble it removed. The defaults run in about a minute
on 2 idle cores.

There is no torch-native peer for this: torch.distributed.pipelining has no optimizer
step at all, and a loop around it clips with one all-reduce over the world, which is
plait's barrier (benchmarks/pp_vs_torch.py holds plait's runtime against it). The load
average before and after is printed: on a shared machine it decides the numbers.
`--write PATH` also writes both tables as markdown (docs/results/post_validation.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results  # noqa: E402

from plait.config import load_config  # noqa: E402
from plait.launch.forked import run_ranks  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file  # noqa: E402
from plait.train.loop import train  # noqa: E402

MODES = ("barrier", "post_validation")
TOKENS = Path("/tmp/plait-bench/post-validation-512.bin")


def _cfg(args, schedule: str, mode: str):
    return load_config(sets=[
        f"parallel.pp={args.pp}", f"parallel.schedule={schedule}",
        f"parallel.microbatches={args.microbatches}", f"parallel.optimizer_sync={mode}",
        f"model.n_layers={args.layers}", f"model.dim={args.dim}",
        f"model.ffn_dim={args.dim * 11 // 4}", f"model.vocab_size={args.vocab}",
        f"train.seq_len={args.seq_len}", f"train.global_batch={args.batch}",
        f"train.steps={args.steps}", f"train.grad_clip={args.grad_clip}"]).check(args.pp)


def _rank(rank: int, world: int, args) -> list[dict]:
    rows = []
    for schedule in args.schedules.split(","):
        for _ in range(args.repeats):
            for mode in MODES:
                cfg = _cfg(args, schedule, mode)
                mesh = ParallelMesh.build(cfg.parallel)
                data = GlobalBatches(TokenFile.open(TOKENS), cfg.train.seq_len,
                                     cfg.train.global_batch, cfg.train.seed, args.vocab)
                s = train(cfg, mesh, data).summary["pipeline"]
                periods = s["step_periods_ms"]
                rows.append({"schedule": schedule, "mode": mode,
                             "period_ms": s["steady_period_ms"], "steady": s["steady_bubble"],
                             "sim_steady": s["simulated_steady_bubble"],
                             "sim_period_ms": s["simulated_steady_period_ms"],
                             "per_step": s["simulated_steady_bubble_per_step"],
                             "replay": s["simulated_steady_bubble_replay"],
                             "min_ms": min(periods), "median_ms": statistics.median(periods),
                             "between_ms": s["between_ms"], "p2p_ms": s["durations_ms"]["p2p"],
                             "gap_ms": s["durations_ms"]["gap"],
                             "check_ms": statistics.mean(s["check_per_rank_ms"]),
                             "span": s["measured_bubble"], "sim": s["simulated_bubble"],
                             "overlap_ms": s["step_overlap_ms"], "restarts": s["restarts"],
                             "cpu": min(s["cpu_share"].values())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--grad-clip", type=float, default=10.0)
    ap.add_argument("--schedules", default="zb-h2,zb-v,dualpipev")
    results.add_write_flag(ap)
    args = ap.parse_args()
    if not TOKENS.exists():
        synthetic_token_file(TOKENS, 200_000, args.vocab, seed=7)
    load0 = os.getloadavg()
    rows = run_ranks(_rank, args.pp, args, timeout=1800, pg_timeout=300)[0]
    load1 = os.getloadavg()
    print(f"pp={args.pp} m={args.microbatches} dim={args.dim} layers={args.layers} "
          f"seq={args.seq_len} batch={args.batch} steps={args.steps} "
          f"grad_clip={args.grad_clip}; load average {load0[0]:.1f} -> {load1[0]:.1f}")
    print(f"{'schedule':<10} {'optimizer_sync':<16} {'period ms':>9} {'min':>7} "
          f"{'median':>7} {'between':>7} {'overlap':>7} {'steady':>7} {'sim':>6} "
          f"{'diff':>6} {'step':>6} {'replay':>6} {'m-rep':>6} {'span':>6} {'sim1':>6} {'p2p':>5} "
          f"{'gap':>5} {'check':>5} {'restarts':>8} "
          f"{'CPU':>4}")
    for r in rows:
        print(f"{r['schedule']:<10} {r['mode']:<16} {r['period_ms']:9.1f} {r['min_ms']:7.1f} "
              f"{r['median_ms']:7.1f} {r['between_ms']:7.1f} {r['overlap_ms']:+7.1f} "
              f"{100 * r['steady']:6.1f}% {100 * r['sim_steady']:5.1f}% "
              f"{100 * (r['steady'] - r['sim_steady']):+5.1f} {100 * r['per_step']:5.1f}% "
              f"{100 * r['replay']:5.1f}% {100 * (r['steady'] - r['replay']):+6.1f} "
              f"{100 * r['span']:5.1f}% "
              f"{100 * r['sim']:5.1f}% {r['p2p_ms']:5.1f} {r['gap_ms']:5.2f} {r['check_ms']:5.2f} "
              f"{r['restarts']:8d} "
              f"{100 * r['cpu']:3.0f}%")
    print("post_validation / barrier, medians over repeats: period (mean over steps; the "
          "fastest step; simulated), steady bubble measured (simulated; replayed)")
    for schedule in args.schedules.split(","):
        r = _ratios(rows, schedule)
        print(f"  {schedule:<10} {r[0]} ({r[1]}; {r[2]}); steady {r[3]} ({r[4]}; {r[5]}) -> "
              f"{r[6]} ({r[7]}; {r[8]})")
    if args.write:
        _write(args, rows, load0[0])


def _ratios(rows: list[dict], schedule: str) -> list[str]:
    """post / barrier over the repeats' medians: the mean period, the fastest step, the
    simulated period; the steady bubble measured (simulated; replayed), barrier then post."""
    def med(key: str, mode: str) -> float:
        return statistics.median(r[key] for r in rows
                                 if r["schedule"] == schedule and r["mode"] == mode)
    post, bar = "post_validation", "barrier"
    return [f"{med(k, post) / med(k, bar):.3f}" for k in ("period_ms", "min_ms", "sim_period_ms")
            ] + [f"{100 * med(k, mode):.1f} %" for mode in (bar, post)
                 for k in ("steady", "sim_steady", "replay")]


def _write(args, rows: list[dict], load0: float) -> None:
    size = (f"pp = {args.pp}, m = {args.microbatches}, dim {args.dim}, {args.layers} layers, "
            f"seq {args.seq_len}, batch {args.batch}, {args.steps} steps, grad clip "
            f"{args.grad_clip:g}, {args.repeats} repeats")
    runs = results.table(
        ("schedule", "sync", "period ms", "fastest", "median", "between ms", "overlap ms",
         "steady", "sim", "diff", "per step", "replay", "measured − replay", "check ms",
         "restarts", "CPU"),
        [(r["schedule"], "post" if r["mode"] == "post_validation" else r["mode"],
          f"{r['period_ms']:.1f}", f"{r['min_ms']:.1f}", f"{r['median_ms']:.1f}",
          f"{r['between_ms']:.1f}", f"{r['overlap_ms']:+.1f}", f"{100 * r['steady']:.1f} %",
          f"{100 * r['sim_steady']:.1f} %", f"{100 * (r['steady'] - r['sim_steady']):+.1f}",
          f"{100 * r['per_step']:.1f} %", f"{100 * r['replay']:.1f} %",
          f"{100 * (r['steady'] - r['replay']):+.1f}", f"{r['check_ms']:.2f}", r["restarts"],
          f"{100 * r['cpu']:.0f} %") for r in rows])
    ratios = results.table(
        ("schedule", "post / barrier: period", "fastest step", "simulated period",
         "steady, barrier", "sim, barrier", "replay, barrier", "steady, post", "sim, post",
         "replay, post"),
        [(s, *_ratios(rows, s)) for s in args.schedules.split(",")])
    results.write(
        args.write, "Post-validation against the barrier, across steps", [
            f"Each run ({size}; barrier and post-validation alternated):\n\n{runs}",
            f"Post-validation / barrier, medians over the repeats:\n\n{ratios}"],
        "the steady period is the mean time from one step's last compute to the next one's; "
        "the steady bubble is 1 − busy / (pp × period), measured, simulated from the run's "
        "pooled durations (\"sim\", the planner's figure), per step, and replayed with every "
        "action's own duration (\"replay\": what is left between it and the measurement is "
        "the simulator's rules). A period ratio below 1 is the bubble post-validation removed; "
        "at pp = 2 it can win at most one forward a step. CPU below 100 % means the ranks were "
        "time-sliced and the ratios are the machine's load (docs/pipeline_runtime.md).",
        run=results.run_line(load0))


if __name__ == "__main__":
    main()
