"""No silent hangs: the flight recorder notes every collective as it
is entered; the watchdog of a rank whose collective waits past `--timeout` reports every
rank's last collective, names the rank that is behind, and ends the job (exit 1). A rank
whose calls go out of step with the others' (it skipped a collective, or issued one they
did not) is named too: a mismatch in the flight recorders, or gloo's own abort, after which
the rank that lost its peer prints every rank's flight recorder.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
import uuid
from contextlib import redirect_stderr

import pytest
import torch
import torch.distributed as dist
from helpers import BASE, token_file
from test_clean_stop import assert_all_gone

from plait import comm
from plait.config import ParallelConfig
from plait.launch.forked import run_ranks
from plait.launch.watchdog import Watchdog, failure_report, hang_report
from plait.ledger import FLIGHT_RECORDS, Ledger
from plait.mesh import ParallelMesh

pytestmark = pytest.mark.slow  # process trees: `make test-slow`


def _entry(dim_seq: int, done: bool, op: str = "all_reduce", dim: str = "dp", step: int = 3):
    return {"seq": dim_seq, "dim_seq": dim_seq, "op": op, "dim": dim, "payload": 64,
            "step": step, "tag": "grads", "entered": 0.0, "done": done}


def test_report_names_the_rank_behind_and_the_collective():
    now = time.time()
    states = {0: {"entries": [_entry(6, True), _entry(7, False)], "at": now},
              1: {"entries": [_entry(6, True)], "at": now - 10},
              2: {"entries": [_entry(6, True), _entry(7, False)], "at": now},
              3: None}
    lines = hang_report(states, 4, reporter=0, timeout_s=10)
    assert lines[0].startswith("plait: hang: rank 0 waited 10 s in all_reduce@dp #7 (step 3, "
                               "64 B, grads) in flight; behind: ranks 1, 3; waiting: 0, 2")
    assert lines[2].startswith("  rank 1: all_reduce@dp #6 (step 3, 64 B, grads) done")
    assert lines[4] == "  rank 3: no state published (stopped before its first report)"


def _recorder_rank(rank: int, world: int) -> list[dict]:
    mesh = ParallelMesh.build(ParallelConfig(dp=world))
    for i in range(FLIGHT_RECORDS + 3):
        comm.all_reduce(torch.ones(4), mesh, "dp", tag=f"t{i}")
    handle = comm.all_reduce(torch.ones(4), mesh, "dp", async_op=True, tag="async")
    entries = [e.__dict__.copy() for e in mesh.ledger.in_flight()]
    handle.wait()
    return entries


def test_flight_recorder_keeps_the_last_collectives_entered():
    entries = run_ranks(_recorder_rank, 2)[0]
    assert len(entries) == FLIGHT_RECORDS  # a ring: the oldest fell out
    assert [e["dim_seq"] for e in entries] == list(range(5, FLIGHT_RECORDS + 5))
    assert entries[-1]["tag"] == "async" and not entries[-1]["done"]  # entered, in flight
    assert all(e["done"] for e in entries[:-1]) and entries[-1]["payload"] == 16


def test_watchdog_reports_once_and_exits_1():
    store = dist.HashStore()
    ledgers, exits = [Ledger(), Ledger()], []
    for ledger in ledgers:
        ledger.enter("all_reduce", "dp", 8, "metrics").done = True
    stuck = ledgers[0].enter("all_reduce", "dp", 64, "grads")  # rank 1 never enters it
    stuck.entered -= 100  # in flight for 100 s
    dogs = [Watchdog(ledger, r, 2, store, timeout_s=5, interval_s=0.05, exit=exits.append)
            for r, ledger in enumerate(ledgers)]
    dogs[1].publish()
    err = io.StringIO()
    with redirect_stderr(err):
        dogs[0].start().thread.join(timeout=30)
    assert exits == [1]
    text = err.getvalue()
    assert "plait: hang: rank 0 waited 5 s in all_reduce@dp #2 (step 0, 64 B, grads) " \
        "in flight; behind: rank 1" in text, text
    assert "  rank 1: all_reduce@dp #1 (step 0, 8 B, metrics) done" in text


def _faulted_run(tmp_path, fault: str, timeout_s: int) -> tuple[subprocess.CompletedProcess,
                                                                  str]:
    """A long dp=2 run through `plait train` with the test-only fault `fault`; its result
    and the marker in every one of its command lines."""
    marker = f"plait-fault-{uuid.uuid4().hex[:12]}"
    sets = [a for s in (*BASE, "train.steps=100000") for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--data",
                        str(token_file()), *sets, "--nproc", "2", "--dp", "2", "--quiet",
                        "--timeout", str(timeout_s), "--metrics-out",
                        str(tmp_path / f"{marker}.jsonl")],
                       env={**os.environ, "PLAIT_TEST_FAULT": fault},
                       capture_output=True, text=True, timeout=300)
    return r, marker


def test_a_stopped_rank_ends_the_job_with_a_report(tmp_path):
    """Rank 1 SIGSTOPs itself after step 2 (the test-only fault, plait/launch/elastic.py): rank 0
    waits in step 3's first collective until the watchdog reports, and the job ends. Each
    rank's line has its last step's compute and wait; the straggler verdict follows."""
    r, marker = _faulted_run(tmp_path, "stop:1:2", timeout_s=8)
    assert r.returncode == 1, r.stderr
    assert "plait: hang: rank 0 waited 8 s in all_reduce@dp" in r.stderr, r.stderr
    assert "(step 3, " in r.stderr and "behind: rank 1;" in r.stderr, r.stderr
    # rank 1's last: step 2's exchange of step figures (plait/train/stragglers.py)
    assert re.search(r"  rank 1: all_gather@world #\d+ \(step 2, 32 B, metrics\) done; "
                     r"reported [\d.]+ s ago; step 2: compute [\d.]+ ms, wait [\d.]+ ms",
                     r.stderr), r.stderr
    # three steps: a verdict needs three slow ones in a row, and it travels a step behind
    assert "  stragglers: none named (the verdict published after step 2)" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert_all_gone(marker, within_s=15)  # the stopped rank too (SIGKILL after the grace)


def test_a_mismatched_call_is_named_with_both_ranks_collectives():
    """Rank 1 issued a 4-byte all-reduce where rank 0 issued the gradients' (call #7 on dp
    for both): the report says so, and names nobody behind (both are at #7)."""
    fault = {**_entry(7, False), "payload": 4, "tag": "fault", "step": 2}
    states = {0: {"entries": [_entry(6, True), _entry(7, False)], "at": time.time()},
              1: {"entries": [_entry(6, True), fault], "at": time.time()}}
    lines = hang_report(states, 2, 0, 8)
    assert "no rank is behind on that dim;" in lines[0], lines
    assert lines[-1] == ("  mismatch on dp call #7: rank 0: all_reduce 64 B (grads, step 3); "
                         "rank 1: all_reduce 4 B (fault, step 2)"), lines
    text = failure_report(states, 2, 1)
    assert text[0].startswith("plait: rank 1 failed in all_reduce@dp #7 (step 2, 4 B, fault) "
                              "in flight."), text
    assert text[-1] == lines[-1] and len(text) == 4  # header, a line per rank, the mismatch
    in_step = {r: {"entries": [_entry(6, True)], "at": time.time()} for r in (0, 1)}
    assert not any("mismatch" in line for line in failure_report(in_step, 2, 0))


def test_a_rank_out_of_step_ends_the_job_with_every_flight_recorder(tmp_path):
    """Rank 1 enters one all-reduce after step 2 that rank 0 never does (the test-only
    fault `extra`, plait/launch/elastic.py): rank 0's next call, step 3's gradients, meets it;
    gloo aborts rank 1 on the size mismatch, and rank 0 says where each rank was."""
    r, marker = _faulted_run(tmp_path, "extra:1:2", timeout_s=60)
    err = r.stderr
    assert r.returncode == 1, err
    assert "Is there a distributed collective mismatch" in err, err  # gloo, on rank 1
    # the launcher names the first rank out: rank 1 (SIGABRT), or rank 0 (status 1) when
    # rank 1's abort takes longer than rank 0's report (a core dump, say)
    assert re.search(r"plait: rank [01] exited first, with (signal SIGABRT|status 1)", err), err
    # rank 0 in its first call of step 3; rank 1's last published, either the end of step 2
    # (its last call on dp, or the exchange of step figures after it) or (when its
    # publisher ran before gloo ended it) the extra call itself, in which case the report
    # names the mismatch on that call
    at = re.search(r"plait: rank 0 failed in all_reduce@dp #(\d+) \(step 3, [\d,]+ B, grads\) "
                   r"in flight", err)
    assert at, err
    call = int(at.group(1))
    done = re.search(rf"  rank 1: (\S+@dp #{call - 1}|all_gather@world #\d+) \(step 2, .*\) "
                     "done", err)  # the world one: step 2's exchange of step figures
    extra = re.search(rf"  rank 1: all_reduce@dp #{call} \(step 2, 4 B, fault\) in flight", err)
    assert done or extra, err
    if extra:
        assert f"mismatch on dp call #{call}: rank 0: all_reduce" in err, err
    assert "Traceback" not in err, err
    assert_all_gone(marker, within_s=15)
