"""Goodput under failures against the checkpoint interval.

For each checkpoint interval, `plait train --max-restarts` runs while this script kills a
random rank (SIGKILL) at exponentially distributed times of mean `--mtbf` seconds (seeded;
the clock runs while the job is up, restarts included, as real failures do; one due
between two attempts hits the next). It prints

    goodput = (steps x the step time of an uninterrupted run without checkpoints) / wall

beside the Young/Daly optimum interval tau = sqrt(2 C MTBF) (Young 1974, "A first order
approximation to the optimum checkpoint interval"; Daly 2006), with C the measured cost of
one checkpoint: the wall time a run with a save after every step adds per step, against
the same run without saves.

    python benchmarks/goodput.py [--mtbf 60] [--intervals 2,5,10,20] [--steps 120]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kill_a_rank import _rank_of, _ranks  # noqa: E402

from plait.train.data import synthetic_token_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _command(args, data: Path, work: Path, every: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "plait.cli", "train", "--data", str(data), "--nproc",
           str(args.nproc), "--dp", str(args.nproc), "--steps", str(args.steps),
           "--set", "model.vocab_size=256", "--seq-len", "128", "--global-batch",
           str(4 * args.nproc), "--set", f"model.dim={args.dim}", "--set",
           "train.warmup_steps=1", "--quiet", "--metrics-out", str(work / "m.jsonl")]
    if every:
        cmd += ["--checkpoint-dir", str(work / "ck"), "--checkpoint-every", str(every),
                "--keep", "2", "--max-restarts", "1000"]
    return cmd


def run(args, data: Path, work: Path, every: int | None, mtbf: float | None,
        pick: random.Random) -> dict:
    work.mkdir(parents=True)
    start = time.monotonic()
    proc = subprocess.Popen(_command(args, data, work, every), cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    kills = 0
    next_kill = start + pick.expovariate(1 / mtbf) if mtbf else math.inf
    while proc.poll() is None:
        if time.monotonic() >= next_kill:
            ranks = [p for p in _ranks(proc.pid) if _rank_of(p) is not None]
            if ranks:  # none between two attempts: the failure waits for the next one
                os.kill(pick.choice(ranks), signal.SIGKILL)
                kills += 1
                next_kill = time.monotonic() + pick.expovariate(1 / mtbf)
        time.sleep(0.05)
    err = proc.stderr.read()
    wall = time.monotonic() - start
    rows = [json.loads(x) for x in (work / "m.jsonl").read_text().splitlines()] \
        if proc.returncode == 0 else []
    summary = rows[-1] if rows else {}
    return {"code": proc.returncode, "wall": wall, "kills": kills, "err": err[-2000:],
            "restarts": summary.get("restarts", 0), "lost": summary.get("lost_steps", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtbf", type=float, default=60.0, help="mean seconds between failures")
    p.add_argument("--intervals", default="2,5,10,20", help="checkpoint every N steps")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dim", type=int, default=256, help="model width (step time)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    pick = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="plait-goodput-") as tmp:
        data = Path(tmp) / "tokens.bin"
        synthetic_token_file(data, 400_000, 256, seed=7)
        base = run(args, data, Path(tmp) / "base", None, None, pick)
        assert base["code"] == 0, base["err"]
        saving = run(args, data, Path(tmp) / "every1", 1, None, pick)
        assert saving["code"] == 0, saving["err"]
        # launch and teardown cancel out: both runs pay them once
        step_s = base["wall"] / args.steps  # an upper bound: launch included
        cost = max(saving["wall"] - base["wall"], 0.0) / args.steps
        tau = math.sqrt(2 * cost * args.mtbf)
        print(f"uninterrupted, no checkpoints: {base['wall']:.1f} s for {args.steps} steps "
              f"({step_s:.3f} s a step, launch included); checkpoint cost C = {cost:.3f} s")
        print(f"Young/Daly optimum for MTBF {args.mtbf:.0f} s: every {tau:.1f} s = "
              f"{tau / step_s:.1f} steps")
        print("every  kills  restarts  lost_steps  wall_s  goodput")
        for every in [int(x) for x in args.intervals.split(",")]:
            r = run(args, data, Path(tmp) / f"e{every}", every, args.mtbf, pick)
            if r["code"] != 0:
                print(f"{every:5d}  failed (exit {r['code']}): {r['err'].strip()[-300:]}")
                continue
            print(f"{every:5d}  {r['kills']:5d}  {r['restarts']:8d}  {r['lost']:10d}  "
                  f"{r['wall']:6.1f}  {base['wall'] / r['wall']:7.2f}")


if __name__ == "__main__":
    main()
