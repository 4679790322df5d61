"""The planner's step time on this machine, predicted vs measured.

    python benchmarks/plan_closed_loop.py [--hardware profile.json] [--steps 20]
        [--hidden 256] [--layers 4] [--heads 4] [--ffn 688] [--seq 128]
        [--global-batch 8] [--measured DIR] [--write docs/results/plan_closed_loop.md]

Measures a profile first (`plait calibrate`) unless one is given; then, for each small
layout (world <= 2, so ranks do not share cores: one rank, dp=2 ZeRO-0 and ZeRO-3, tp=2
with SP, pp=2 1F1B and GPipe), `plait plan --hardware ... --layout ... --emit-config`,
`plait train --config` on the emitted file, and `plait report --plan`; prints predicted
and measured step time (mean, median and fastest of the timed steps, the first left
out; the goal is judged on the fastest: on a shared machine the least disturbed, the
estimator the profile's best-of-repeats uses) and the errors, whether the fastest is
within the goal (15 %) and the load average, beside the dp/tp/pp bytes ratio; then where
each planned step goes beside the collectives' measured seconds (and the planned waits
at collectives after compute, the profile's measure_sync, and the hidden collectives'
CPU). fp32 (the runtime's default; bf16 is emulated on this CPU), `tiny` with the size
flags replacing its fields and a 256-token vocabulary (the test token file's). It
prints the folder it writes the runs to and records the size and steps there;
`--measured DIR` plans again against the runs kept there at that size, with the
profile kept there (nothing is trained): a changed model or profile beside the same
measurements. `--write PATH` also writes both tables as markdown
(docs/results/plan_closed_loop.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

import results  # noqa: E402
from helpers import token_file  # noqa: E402

from plait.plan.comm.sync import SYNC_TERM  # noqa: E402
from plait.plan.host_share import HIDDEN_TERM  # noqa: E402

# the model: `tiny` with these fields replaced (vocabulary 256: the test token file's).
# The default's steps are ~50-150 ms on one core of a 2-core machine: long enough that
# one run's step does not move by more than the goal (`OLD_SIZE`, h 64, 2 layers, s 64,
# batch 8, runs 7-20 ms a step and its fastest step moves 10-25 % a run).
SIZE = {"hidden": 256, "layers": 4, "heads": 4, "ffn": 688, "seq": 128, "global_batch": 8}
OLD_SIZE = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 176, "seq": 64, "global_batch": 8}
RUN_FILE = "closed_loop.json"  # in the runs' folder: the size and steps they were run at


def model_flags(size: dict[str, int]) -> list[str]:
    """One meaning in plan and train (the emitted config carries the shape)."""
    return ["--model", "tiny", "--vocab", "256", "--hidden", str(size["hidden"]),
            "--layers", str(size["layers"]), "--heads", str(size["heads"]),
            "--kv-heads", str(size["heads"]), "--ffn", str(size["ffn"]),
            "--seq", str(size["seq"]), "--global-batch", str(size["global_batch"]),
            "--precision", "fp32", "--recompute", "none"]


def layouts(batch: int) -> dict[str, tuple[str, list[str]]]:
    """name: (gpus, plan flags); the pipeline rows at 4 micro-batches."""
    if batch % 4:
        raise SystemExit(f"--global-batch {batch}: give a multiple of 4 (pp 2 at m 4)")
    return {
        "single": ("1", ["--layout", "dp=1", "--zero", "0", "--microbatch", str(batch)]),
        "dp2 zero0": ("2", ["--layout", "dp=2", "--zero", "0", "--microbatch",
                            str(batch // 2)]),
        "dp2 zero3": ("2", ["--layout", "dp=2", "--zero", "3", "--microbatch",
                            str(batch // 2)]),
        "tp2 sp": ("2", ["--layout", "tp=2", "--zero", "0", "--microbatch", str(batch)]),
        "pp2 1f1b m4": ("2", ["--layout", "pp=2", "--zero", "0", "--microbatch",
                              str(batch // 4), "--schedule", "1f1b"]),
        "pp2 gpipe m4": ("2", ["--layout", "pp=2", "--zero", "0", "--microbatch",
                               str(batch // 4), "--schedule", "gpipe"]),
    }


GOAL = 0.15  # within 15 % on each layout


def plait(*args: str) -> str:
    """`plait train` in its own processes (its ranks); plan, report and calibrate in this
    one (one import of torch instead of one per call: the run fits in 4 minutes)."""
    if args[0] == "train":
        r = subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True,
                           text=True, timeout=900, cwd=root)
        if r.returncode:
            raise SystemExit(f"plait {' '.join(args)} failed:\n{r.stderr}")
        return r.stdout
    from plait.cli.main import main as plait_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plait_main(list(args))
    if code:
        raise SystemExit(f"plait {' '.join(args)} failed:\n{err.getvalue()}")
    return out.getvalue()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", help="a profile (default: measure one now)")
    ap.add_argument("--steps", type=int, default=20, help="steps a run (the first untimed)")
    ap.add_argument("--measured", help="a folder of an earlier run: plan again, train nothing "
                    "(at the size and steps it recorded, with its profile.json unless "
                    "--hardware; the model flags are ignored)")
    for k, v in SIZE.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v, metavar="N",
                        help=f"default {v}")
    results.add_write_flag(ap)
    return ap.parse_args()


def run_size(a: argparse.Namespace, tmp: Path) -> tuple[dict[str, int], int]:
    """The model size and steps: the arguments', recorded in the folder; with --measured
    the folder's record (a folder without one was run at `OLD_SIZE`)."""
    rec = tmp / RUN_FILE
    if a.measured:
        if not rec.exists():
            return OLD_SIZE, 12
        doc = json.loads(rec.read_text())
        return doc["size"], doc["steps"]
    size = {k: getattr(a, k) for k in SIZE}
    rec.write_text(json.dumps({"size": size, "steps": a.steps}))
    return size, a.steps


def main() -> None:
    a = parse_args()
    tmp = Path(a.measured or tempfile.mkdtemp(prefix="plait-closed-loop-"))
    print(f"runs in {tmp}")
    size, steps = run_size(a, tmp)
    print("model: tiny with " + ", ".join(f"{k} {v}" for k, v in size.items())
          + f", vocabulary 256, fp32; {steps} steps a run")
    prof = a.hardware or str(tmp / "profile.json")
    if not a.hardware and not (a.measured and Path(prof).exists()):  # keep the runs' profile
        print(plait("calibrate", "--out", prof).strip())
    data = str(token_file())
    load0 = os.getloadavg()[0]
    print(f"load average {os.getloadavg()[0]:.1f} at the start (2 ranks need 2 idle cores); "
          f"goal: within {GOAL:.0%} of the fastest step")
    print(HEADER)
    print("|---|---|---|---|---|---|---|")
    parts, lines = [], []
    for name, (gpus, flags) in layouts(size["global_batch"]).items():
        cfg = tmp / f"{name.replace(' ', '-')}.toml"
        plait("plan", "--hardware", prof, *model_flags(size), "--gpus", gpus, *flags,
              "--emit-config", str(cfg), "--force")  # a rerun over --measured: rewritten
        metrics = cfg.with_suffix(".jsonl")
        if not a.measured:
            plait("train", "--config", str(cfg), "--nproc", gpus, "--data", data, "--steps",
                  str(steps), "--metrics-out", str(metrics), "--quiet")
        rep = json.loads(plait("report", "--metrics", str(metrics), "--plan",
                               str(cfg.with_suffix(".plan.json")), "--json"))["plan"]
        parts.append((name, json.loads(cfg.with_suffix(".plan.json").read_text())["layout"][
            "time_breakdown_s"], json.loads(metrics.read_text().splitlines()[-1])["ledger"]))
        lines.append(row(name, rep, "-" if a.measured else f"{os.getloadavg()[0]:.1f}"))
        print(lines[-1], flush=True)
    print_parts(parts)
    if a.write:
        write(a.write, size, steps, lines, parts, load0)


HEADER = ("| layout | predicted s | measured s: mean / median / fastest | error: mean / median "
          f"/ fastest | goal {GOAL:.0%} | bytes planned / ledger | load |")


def write(path: str, size: dict, steps: int, lines: list[str], parts: list,
          load0: float) -> None:
    model = ", ".join(f"{k} {v}" for k, v in size.items())
    where = results.table(
        ("layout", "planned: compute", "comm exposed", "bubble + p2p", "optimizer",
         "collective sync (waits)", "hidden comm CPU", "measured: comm", "comm waited"),
        [(name, *part_cells(t, ledger)) for name, t, ledger in parts])
    results.write(
        path, "The planner's step time against plait's, on this CPU", [
            f"tiny with {model}, vocabulary 256, fp32, {steps} steps a run (the first "
            f"untimed):\n\n" + "\n".join([HEADER, "|---|---|---|---|---|---|---|", *lines]),
            f"Where each planned step goes, ms, beside the ledger's collectives:\n\n{where}"],
        "each layout planned with this machine's profile (`plait calibrate`), its emitted "
        "config trained, and the run put beside the plan (`plait report --plan`). The goal "
        "is the fastest step within 15 % (on a shared machine the least disturbed step); "
        "the bytes column is the plan's payload bytes per mesh dim over the ledger's. Two "
        "ranks on two cores wait at every collective for a peer another process holds off "
        "its core: a loaded machine measures its load, not the layout.",
        run=results.run_line(load0))


def row(name: str, rep: dict, load: str) -> str:
    """One layout's line of the table: the errors of the mean, median and fastest step."""
    st = rep["step_time"]
    ratios = ", ".join(f"{d['dim']} {d['ratio']:.3f}" for d in rep["communication"]
                       if d["ratio"] is not None) or "-"
    keys = ("measured_s", "measured_median_s", "measured_min_s")
    errs = [st["predicted_s"] / st[k] - 1 for k in keys]
    met = "met" if abs(errs[2]) <= GOAL else "not met"
    return (f"| {name} | {st['predicted_s']:.4f} | "
            + " / ".join(f"{st[k]:.4f}" for k in keys) + " | "
            + " / ".join(f"{100 * e:+.0f} %" for e in errs)
            + f" | {met} | {ratios} | {load} |")


def print_parts(parts: list) -> None:
    """Where each planned step goes, beside the collectives' measured seconds a step (the
    ledger's: issue to completion, and the part the rank waited; on a loaded machine the
    waits are mostly for a descheduled peer)."""
    print("\nplanned ms: compute | comm exposed (tp, cp/ep, dp) | bubble + p2p | optimizer "
          "| collective sync (waits) | hidden comm CPU || measured ms a step: comm | comm "
          "waited")
    for name, t, ledger in parts:
        c = part_cells(t, ledger)
        print(f"  {name}: {' | '.join(c[:6])} || {' | '.join(c[6:])}")


def part_cells(t: dict, ledger: dict) -> list[str]:
    """Planned compute, comm exposed, bubble + p2p, optimizer, sync waits, hidden comm
    CPU; measured comm and comm waited: ms a step."""
    comm_s = t["tp comm (exposed)"] + t["cp/ep comm (exposed)"] + t["dp comm (exposed)"]
    return [f"{1e3 * x:.1f}" for x in (
        t["compute"] + t["recompute"], comm_s, t["pipeline bubble + p2p"], t["optimizer step"],
        t.get(SYNC_TERM, 0.0), t.get(HIDDEN_TERM, 0.0), ledger["comm_seconds_per_step"],
        ledger["comm_exposed_seconds_per_step"])]


if __name__ == "__main__":
    main()
