"""A job survives a dead rank: `plait train --max-restarts R` stops the
other ranks, starts every rank again from the last committed checkpoint and finishes with
the losses and final state of an uninterrupted run, bit for bit (resume is exact on the
same layout, docs/checkpoint.md). The rank is killed with SIGKILL by the test-only fault
`PLAIT_TEST_FAULT` (plait/launch/elastic.py) at a seeded random rank and step; no process of the
run may survive it (found by a marker in every command line, as in test_clean_stop.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import BASE, batches_for, config, reference, token_file
from test_clean_stop import assert_all_gone

from plait.checkpoint import Checkpointing
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.testing import assert_parity
from plait.train.loop import TrainOptions, full_state, train
from plait.train.reference import Reference

pytestmark = pytest.mark.slow  # process trees: `make test-slow`

STEPS, EVERY = 6, 2
LAYOUT = ("parallel.dp=2", "parallel.zero=1")
SETS = [*BASE, f"train.steps={STEPS}", *LAYOUT]


def _uninterrupted_rank(rank: int, world: int, root: str) -> list[dict]:
    cfg = config(f"train.steps={STEPS}", *LAYOUT).check(world)
    result = train(cfg, ParallelMesh.build(cfg.parallel), batches_for(cfg),
                   TrainOptions(checkpoint=Checkpointing(dir=Path(root), every=EVERY)))
    return result.metrics


def _plait_train(tmp_path: Path, fault: str, *flags: str):
    marker = f"plait-elastic-{uuid.uuid4().hex[:12]}"
    metrics, ck = tmp_path / f"{marker}.jsonl", tmp_path / "ck"
    sets = [a for s in SETS for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--data",
                        str(token_file()), *sets, "--nproc", "2", "--quiet",
                        "--checkpoint-dir", str(ck), "--checkpoint-every", str(EVERY),
                        "--metrics-out", str(metrics), *flags],
                       env={**os.environ, "PLAIT_TEST_FAULT": fault},
                       capture_output=True, text=True, timeout=300)
    assert_all_gone(marker)  # the killed attempt's ranks and agent too
    return r, metrics, ck


@pytest.mark.parametrize("seed", [3])
def test_killed_rank_restarts_and_finishes_bit_identical(tmp_path, seed):
    pick = random.Random(seed)
    rank, step = pick.randrange(2), pick.randrange(1, STEPS - 1)  # after that step's row
    full_dir = tmp_path / "full"
    full = run_ranks(_uninterrupted_rank, 2, str(full_dir))[0]
    r, metrics, ck = _plait_train(tmp_path, f"kill:{rank}:{step}", "--max-restarts", "2")
    assert r.returncode == 0, r.stderr
    resumed = (step + 1) // EVERY * EVERY  # the newest checkpoint committed before it died
    lost = step + 1 - resumed  # steps logged after it: trained again
    line = (f"plait: restart 1 of 2: rank {rank} died (signal SIGKILL) after step {step}; "
            f"resuming from step {resumed} (checkpoint {ck}/step-{resumed:08d}); "
            f"{lost} steps lost")
    assert line in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps, summary = rows[:-1], rows[-1]
    assert [x["step"] for x in steps] == list(range(STEPS))  # the whole run, each step once
    assert [x["loss"] for x in steps] == [x["loss"] for x in full]  # bit-identical
    assert [x["grad_norm"] for x in steps] == [x["grad_norm"] for x in full]
    assert summary["restarts"] == 1 and summary["lost_steps"] == lost
    (log,) = summary["restart_log"]
    assert (log["rank"], log["exit"], log["last_step"], log["resumed_from"]) == (
        rank, "signal SIGKILL", step, resumed)
    assert all(log[k] > 0 for k in ("detected_at", "down_at", "relaunched_at", "resumed_at"))
    final = f"step-{STEPS:08d}"  # masters and moments of both ranks, byte for byte
    for f in sorted((full_dir / final).glob("rank-*.bin")):
        assert (ck / final / f.name).read_bytes() == f.read_bytes(), f.name


def test_no_restarts_left_fails_the_run(tmp_path):
    """The fault fires on every attempt; after --max-restarts 1 the run fails (exit 1)
    and keeps what it has: the partial metrics and the last checkpoint, which a new job
    resumes on a different layout (a killed rank, then another layout: nothing trained is lost)."""
    r, metrics, ck = _plait_train(tmp_path, "kill:1:4:every", "--max-restarts", "1")
    assert r.returncode == 1, r.stderr
    assert "plait: restart 1 of 1: rank 1 died (signal SIGKILL) after step 4" in r.stderr
    assert (f"plait: rank 1 died (signal SIGKILL); no restarts left (--max-restarts 1); "
            f"the last checkpoint is {ck}/step-00000004") in r.stderr, r.stderr
    assert not metrics.exists()  # NAME: complete runs only
    assert metrics.with_name(metrics.name + ".partial").exists()
    # what the dead job kept resumes on another layout (dp2 ZeRO-1 -> tp2 with SP): the
    # last two steps within float64 parity of the uninterrupted single-process run
    rows, params = run_ranks(_resumed_rank, 2, str(ck / "step-00000004"),
                             ["parallel.tp=2", "parallel.sp=true"])[0]
    ref = reference(f"train.steps={STEPS}")
    assert [x["step"] for x in rows] == [4, 5]
    assert_parity({"losses": [x["loss"] for x in rows], "params": params,
                   "grad_norms": [x["grad_norm"] for x in rows]},
                  Reference(losses=ref.losses[4:], grad_norms=ref.grad_norms[4:],
                            params=ref.params, lr=ref.lr), "fp64")


def _resumed_rank(rank: int, world: int, path: str, layout: list[str]):
    cfg = config(f"train.steps={STEPS}", *layout).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg),
                   TrainOptions(checkpoint=Checkpointing(resume=path)))
    return result.metrics, full_state(result.model, result.optimizer, mesh, result.placements)
