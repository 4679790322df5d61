"""Kill a rank and recover: `plait train --max-restarts` under SIGKILL.

Each trial runs `plait train --nproc N --dp N --max-restarts 1 --checkpoint-every E` and,
once rank 0 has logged a seeded random step, SIGKILLs a seeded random rank from outside
(found in the launcher's process tree). It reads the run's summary (`restart_log`) and
prints, per trial and as medians:

    detect    kill -> torch's agent saw the failure
    teardown  -> every rank of the failed attempt gone (the agent stops the others)
    relaunch  -> the new attempt's first step done (start, rendezvous, resume, one step)
    lost      steps logged after the last checkpoint, trained again
    overhead  the trial's wall time / an uninterrupted run's (same flags, no kill)

and whether the run recovered: exit 0, every step logged once, the final loss equal to
the uninterrupted run's (exact resume).

    python benchmarks/kill_a_rank.py [--trials 10] [--nproc 2] [--steps 30] [--every 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.device.network import process_tree  # noqa: E402
from plait.train.data import synthetic_token_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _command(args, data: Path, ck: Path, metrics: Path) -> list[str]:
    return [sys.executable, "-m", "plait.cli", "train", "--data", str(data),
            "--nproc", str(args.nproc), "--dp", str(args.nproc), "--steps", str(args.steps),
            "--set", "model.vocab_size=256", "--seq-len", "64", "--global-batch",
            str(4 * args.nproc), "--set", "train.warmup_steps=1", "--quiet",
            "--checkpoint-dir", str(ck), "--checkpoint-every", str(args.every),
            "--metrics-out", str(metrics), "--max-restarts", "1"]


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    except OSError:
        return []


def _ranks(launcher: int) -> list[int]:
    """The rank processes (`-m plait.train`, not the torchrun shim), by pid order."""
    out = []
    for pid in process_tree(launcher)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"plait.train" in cmd and b"_torchrun" not in cmd:
            out.append(pid)
    return sorted(out)


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def trial(args, data: Path, work: Path, kill: tuple[int, int] | None) -> dict:
    """One run; `kill`: (rank, step) to SIGKILL that rank once `step` is logged."""
    ck, metrics = work / "ck", work / "m.jsonl"
    partial = metrics.with_name(metrics.name + ".partial")
    start = time.time()
    proc = subprocess.Popen(_command(args, data, ck, metrics), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    killed_at = None
    while kill is not None and killed_at is None and proc.poll() is None:
        if any(r.get("step") == kill[1] for r in _rows(partial)):
            victim = [p for p in _ranks(proc.pid) if _rank_of(p) == kill[0]]
            if victim:
                os.kill(victim[0], signal.SIGKILL)
                killed_at = time.time()
        time.sleep(0.02)
    out, err = proc.communicate(timeout=600)
    wall = time.time() - start
    rows = _rows(metrics)
    summary = rows[-1] if rows and rows[-1].get("summary") else {}
    steps = [r["step"] for r in rows if "step" in r]
    res = {"code": proc.returncode, "wall": wall, "steps": steps, "summary": summary,
           "final_loss": summary.get("final_loss"), "err": err}
    log = summary.get("restart_log") or []
    if killed_at is not None and log:
        r = log[0]
        res.update(detect=r["detected_at"] - killed_at, teardown=r["down_at"] - r["detected_at"],
                   relaunch=r["resumed_at"] - r["down_at"], lost=r["lost_steps"],
                   rank=r["rank"], killed=kill)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    pick = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="plait-kill-") as tmp:
        data = Path(tmp) / "tokens.bin"
        synthetic_token_file(data, 200_000, 256, seed=7)
        base = trial(args, data, Path(tmp) / "base", None)
        assert base["code"] == 0, base["err"]
        print(f"uninterrupted: {base['wall']:.1f} s, final loss {base['final_loss']:.6f}")
        print("trial  rank  step  recovered  detect_s  teardown_s  relaunch_s  lost  overhead")
        results = []
        for i in range(args.trials):
            kill = (pick.randrange(args.nproc), pick.randrange(1, args.steps - 1))
            r = trial(args, data, Path(tmp) / f"t{i}", kill)
            r["recovered"] = (r["code"] == 0 and r["steps"] == list(range(args.steps))
                              and r["final_loss"] == base["final_loss"] and "detect" in r)
            results.append(r)
            if "detect" in r:
                print(f"{i:5d}  {kill[0]:4d}  {kill[1]:4d}  {str(r['recovered']):>9}  "
                      f"{r['detect']:8.2f}  {r['teardown']:10.2f}  {r['relaunch']:10.2f}  "
                      f"{r['lost']:4d}  {r['wall'] / base['wall']:8.2f}")
            else:
                print(f"{i:5d}  {kill[0]:4d}  {kill[1]:4d}  {'False':>9}  (exit {r['code']}: "
                      f"{r['err'].strip().splitlines()[-1:] or ''})")
        ok = [r for r in results if r["recovered"]]
        print(f"recovered {len(ok)}/{len(results)}")
        if ok:
            med = {k: statistics.median(r[k] for r in ok) for k in
                   ("detect", "teardown", "relaunch", "lost")}
            ratio = statistics.median(r["wall"] / base["wall"] for r in ok)
            print(f"median: detect {med['detect']:.2f} s, teardown {med['teardown']:.2f} s, "
                  f"relaunch to first step {med['relaunch']:.2f} s, lost {med['lost']:.1f} "
                  f"steps; wall time x{ratio:.2f} of the uninterrupted run")


if __name__ == "__main__":
    main()
