"""A stopped run stops everywhere: SIGINT, SIGTERM or SIGHUP to `plait train`,
a signal to one rank, or the launcher killed outright, and within seconds no process of
the run is left: found by a marker unique to the test in every command line (the metrics
path travels to torchrun and to each rank). The metrics so far stay in NAME.partial;
NAME itself is only ever a complete run's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import batches_for, token_file

from plait.config import load_config
from plait.launch.forked import run_ranks
from plait.launch.local import STOP_GRACE_S
from plait.mesh import ParallelMesh
from plait.train.loop import train

pytestmark = pytest.mark.slow  # process trees: `make test-slow`

LONG_RUN = ("--nproc", "2", "--dp", "2", "--set", "model.vocab_size=256", "--seq-len", "32",
            "--global-batch", "8", "--steps", "100000", "--quiet")


def processes_with(marker: str) -> set[int]:
    """Live processes whose command line holds `marker` (zombies have none)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.add(int(entry))
    return found


def start_run(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    """A long two-rank run, returned once its first step is on disk."""
    marker = f"plait-stop-{uuid.uuid4().hex[:12]}"
    metrics = tmp_path / f"{marker}.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "plait.cli", "train", "--data",
                             str(token_file()), *LONG_RUN, *extra, "--metrics-out",
                             str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = metrics.with_name(metrics.name + ".partial")
    deadline = time.monotonic() + 180
    while not (partial.exists() and partial.read_text().count("\n") >= 1):
        if proc.poll() is not None:
            pytest.fail(f"the run ended before its first step: {proc.communicate()}")
        assert time.monotonic() < deadline, "no step within 180 s"
        time.sleep(0.2)
    assert len(processes_with(marker)) >= 4  # launcher, torchrun, two ranks
    return proc, marker, metrics


def assert_all_gone(marker: str, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with(marker), f"orphans: {processes_with(marker)}"


# SIGTERM to the launcher: test_stop_with_a_final_checkpoint_saves_one_step_everywhere
# (exit 143 within the grace, every process gone) and tests/test_cluster.py's teardown
# (SIGTERM and SIGHUP take the same handler: tests/test_cli.py's in-process check)
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=lambda s: s.name)
def test_signal_to_the_launcher_stops_every_rank(tmp_path, sig):
    proc, marker, metrics = start_run(tmp_path)
    proc.send_signal(sig)
    start = time.monotonic()
    _, err = proc.communicate(timeout=STOP_GRACE_S + 30)
    took = time.monotonic() - start
    assert proc.returncode == 128 + sig, err
    assert took < STOP_GRACE_S, f"took {took:.1f} s to stop"
    assert_all_gone(marker)
    # the steps as the step lines number them, and the count done
    assert re.search(rf"plait: stopped by {sig.name} (after step \d+ \(\d+|before step 0 "
                     r"\(none) of 100000 steps done\)", err), err
    assert "Traceback" not in err, err
    partial = metrics.with_name(metrics.name + ".partial")
    assert not metrics.exists() and partial.exists()  # NAME: complete runs only
    assert f"kept in {partial}" in err


def _rank_pids(marker: str) -> list[int]:
    """The run's rank processes (not the launcher or the torchrun shim)."""
    return [p for p in processes_with(marker)
            if b"plait.train" in Path(f"/proc/{p}/cmdline").read_bytes()
            and b"_torchrun" not in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_signal_to_one_rank_stops_the_run(tmp_path):
    proc, marker, _ = start_run(tmp_path)
    ranks = _rank_pids(marker)
    assert len(ranks) == 2
    os.kill(max(ranks), signal.SIGTERM)
    _, err = proc.communicate(timeout=STOP_GRACE_S + 30)
    assert proc.returncode != 0, err
    assert_all_gone(marker)
    assert "Traceback" not in err, err


def test_killed_launcher_leaves_no_orphans(tmp_path):
    """SIGKILL cannot be caught: the kernel's parent-death signal takes the tree down."""
    proc, marker, _ = start_run(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert_all_gone(marker, within_s=STOP_GRACE_S + 5)


# --checkpoint-on-stop: ZeRO-2 so that each rank saves state no other rank holds (its
# optimizer shard), and a constant learning rate after warm-up so that runs of different
# lengths take the same steps: a resumed run must then repeat an uninterrupted one exactly
ON_STOP = ("--zero", "2", "--set", "train.min_lr_ratio=1", "--checkpoint-on-stop")


def _losses(path: Path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if not r.get("summary")]


def _train(tmp_path: Path, name: str, *args: str) -> Path:
    """A short run of the same job to completion; its metrics file."""
    metrics = tmp_path / f"{name}.jsonl"
    r = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--data",
                        str(token_file()), *LONG_RUN, *ON_STOP[:4], *args, "--metrics-out",
                        str(metrics)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return metrics


# the same job as LONG_RUN + ON_STOP's settings, as config
STRAIGHT_SETS = ("parallel.dp=2", "parallel.zero=2", "model.vocab_size=256", "train.seq_len=32",
                 "train.global_batch=8", "train.min_lr_ratio=1")


def _straight_rank(rank: int, world: int, steps: int) -> list[float]:
    cfg = load_config(sets=[*STRAIGHT_SETS, f"train.steps={steps}"]).check(world)
    return train(cfg, ParallelMesh.build(cfg.parallel), batches_for(cfg)).losses


def _straight_losses(steps: int) -> list[float]:
    """An uninterrupted run of the job on 2 forked ranks: the code a launched rank runs,
    without a launch (bit for bit the same losses)."""
    return run_ranks(_straight_rank, 2, steps)[0]


def _stopped_at(err: str, sig: signal.Signals, ckpt: Path) -> int:
    found = re.search(rf"plait: stopped by {sig.name} after step (\d+) \((\d+) of 100000 "
                      rf"steps done\); final checkpoint {re.escape(str(ckpt))}/step-(\d+) "
                      r"\(--resume continues at step (\d+)\)", err)
    assert found, err
    last, done, saved, resume = (int(g) for g in found.groups())
    assert last + 1 == done == saved == resume, found.group(0)
    return done


def test_stop_with_a_final_checkpoint_saves_one_step_everywhere(tmp_path):
    """SIGTERM to the launcher: every rank finishes its step, all save step k, exit 143;
    resuming from it repeats an uninterrupted run's steps k and k+1 exactly."""
    ckpt = tmp_path / "ckpt"
    proc, marker, metrics = start_run(tmp_path, *ON_STOP, "--checkpoint-dir", str(ckpt))
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, err = proc.communicate(timeout=STOP_GRACE_S + 30)
    took = time.monotonic() - start
    assert proc.returncode == 143, err
    assert took < STOP_GRACE_S, f"took {took:.1f} s to stop"
    assert_all_gone(marker)
    assert "Traceback" not in err, err
    k = _stopped_at(err, signal.SIGTERM, ckpt)
    assert [p.name for p in ckpt.iterdir()] == [f"step-{k:08d}"]  # committed, nothing else
    assert (ckpt / f"step-{k:08d}" / "COMMITTED").is_file()
    stopped = _losses(metrics.with_name(metrics.name + ".partial"))
    assert len(stopped) == k  # the steps done are the steps saved
    resumed = _losses(_train(tmp_path, "resumed", "--steps", str(k + 2), "--resume",
                             str(ckpt / f"step-{k:08d}")))
    straight = _straight_losses(k + 2)
    assert straight[:k] == stopped
    assert resumed == straight[k:]  # bit for bit: each rank's shard was of step k


def test_signal_to_one_rank_with_a_final_checkpoint_stops_every_rank_at_one_step(tmp_path):
    """Only one rank is signalled: the all-reduce at the step boundary tells the other."""
    ckpt = tmp_path / "ckpt"
    proc, marker, _ = start_run(tmp_path, *ON_STOP, "--checkpoint-dir", str(ckpt))
    ranks = _rank_pids(marker)
    assert len(ranks) == 2
    os.kill(max(ranks), signal.SIGTERM)
    _, err = proc.communicate(timeout=STOP_GRACE_S + 30)
    assert proc.returncode == 143, err
    assert_all_gone(marker)
    k = _stopped_at(err, signal.SIGTERM, ckpt)
    assert (ckpt / f"step-{k:08d}" / "COMMITTED").is_file()
    assert "Traceback" not in err, err
