"""One job over two "nodes": two `plait train`
launchers on this machine, `--nnodes 2 --node-rank K --master 127.0.0.1:PORT`, two ranks
each, form one four-rank job that matches the single-process reference (fp32 parity
tolerances, docs/parity.md), listens only on the interface it names, and when one node
dies the other comes down with a clear message, never a hang; with `--max-restarts` a
killed rank restarts both launchers (a marker in every command
line finds what is left, as in test_clean_stop.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import BASE, assert_restarted_run_matches, reference, token_file
from test_clean_stop import assert_all_gone

from plait.checkpoint.format import read_metadata
from plait.checkpoint.reader import full_tensor
from plait.device.network import listening_sockets, process_tree
from plait.launch.cluster import capability_problem
from plait.launch.forked import free_port
from plait.testing import assert_parity

pytestmark = pytest.mark.slow  # process trees: `make test-slow`

LAYOUT = ("parallel.dp=2", "parallel.tp=2")  # tp inside a node, dp across the two


def _start(node: int, master: str, sets: list[str], metrics: Path, flags) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "train", "--data", str(token_file()), *sets,
         "--nnodes", "2", "--node-rank", str(node), "--master", master, "--nproc", "2",
         "--interface", "lo", "--quiet", "--metrics-out", str(metrics), "--timeout", "60",
         *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _launchers(tmp_path: Path, *flags: str, steps: int = 4):
    """Node 0's launcher, once it listens on the master port, then node 1's."""
    marker = f"plait-nodes-{uuid.uuid4().hex[:12]}"
    metrics = tmp_path / f"{marker}.jsonl"
    sets = [a for s in (*BASE, *LAYOUT, f"train.steps={steps}") for a in ("--set", s)]
    for _ in range(5):  # free_port's race: another process took the port first
        port = free_port()
        node0 = _start(0, f"127.0.0.1:{port}", sets, metrics, flags)
        deadline = time.monotonic() + 120
        while node0.poll() is None and not any(
                s.port == port for s in listening_sockets(process_tree(node0.pid))):
            assert time.monotonic() < deadline, "node 0 did not listen within 120 s"
            time.sleep(0.1)
        if node0.poll() is None:
            return [node0, _start(1, f"127.0.0.1:{port}", sets, metrics, flags)], marker, \
                metrics
        err = node0.communicate()[1]
        assert node0.returncode == 2 and "cannot listen" in err, err
    pytest.fail("no free port for the master in 5 tries")


@pytest.mark.skipif(capability_problem() is None, reason="tests/test_cluster.py runs the same "
                    "2 x 2 layout on two emulated nodes against the reference (a superset)")
def test_two_nodes_match_the_single_process_run(tmp_path):
    ck = tmp_path / "ck"
    procs, marker, metrics = _launchers(tmp_path, "--checkpoint-dir", str(ck),
                                        "--checkpoint-every", "4")
    outs = [p.communicate(timeout=300) for p in procs]
    for node, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, (node, err)
        assert f"plait: node {node} of 2, 2 ranks: listening on lo (127.0.0.1) only" in err
    assert_all_gone(marker)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps, summary = rows[:-1], rows[-1]
    assert summary["world_size"] == 4 and summary["config"]["parallel"]["gpus_per_node"] == 2
    path = ck / "step-00000004"
    meta = read_metadata(path)
    params = {n: torch.from_numpy(full_tensor(path, meta, n)) for n in meta["tensors"]}
    run = {"losses": [r["loss"] for r in steps], "grad_norms": [r["grad_norm"] for r in steps],
           "params": params}
    assert_parity(run, reference(*LAYOUT))


def _listeners_of(procs) -> list:
    return listening_sockets([pid for p in procs for pid in process_tree(p.pid)])


# the store's host (node 0) dies: the harder case, the survivor loses its rendezvous store
# as well as its peers (a non-store node's death is what test_cluster.py's kills show)
@pytest.mark.parametrize("dead", [0], ids=["store-host-dies"])
def test_a_dead_node_brings_the_other_down(tmp_path, dead):
    procs, marker, metrics = _launchers(tmp_path, steps=100000)
    partial = metrics.with_name(metrics.name + ".partial")
    deadline = time.monotonic() + 240
    while not (partial.exists() and partial.read_text().count("\n") >= 2):  # all up
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "the job did not start training in 240 s"
        time.sleep(0.2)
    found = _listeners_of(procs)
    assert len({s.pid for s in found}) >= 5, found  # the store, every rank's gloo
    assert all(s.address == "127.0.0.1" for s in found), found  # --interface lo only
    procs[dead].send_signal(signal.SIGKILL)  # the whole node: its launcher and below
    survivor = procs[1 - dead]
    _, err = survivor.communicate(timeout=180)  # gloo sees the closed peers at once
    procs[dead].communicate(timeout=30)
    assert survivor.returncode == 1, err
    assert f"plait: node {1 - dead} of 2: the job failed" in err, err
    assert "Traceback" not in err, err
    assert_all_gone(marker, within_s=15)


def test_a_killed_rank_restarts_every_launcher(tmp_path, monkeypatch):
    """`--max-restarts` across two launchers. Rank 2 (node 1)
    SIGKILLs itself after step 2 of the first attempt (the test-only fault); both
    launchers meet in the next attempt, resume from the step-2 checkpoint node 0 picks,
    and finish: each step once, one restart naming rank 2, parity with the reference."""
    monkeypatch.setenv("PLAIT_TEST_FAULT", "kill:2:2")
    ck, steps = tmp_path / "ck", 5
    procs, marker, metrics = _launchers(tmp_path, "--checkpoint-dir", str(ck),
                                        "--checkpoint-every", "2", "--max-restarts", "1",
                                        steps=steps)
    outs = [p.communicate(timeout=300) for p in procs]
    for node, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, (node, err)
    assert ("plait: restart 1 of 1: rank 2 died (signal SIGKILL) after step 2; resuming "
            "from step 2") in outs[0][1], outs[0][1]
    assert_all_gone(marker)
    assert_restarted_run_matches(metrics, ck, steps, LAYOUT)


def test_the_restart_keeps_the_rows_of_whichever_node_ran_rank_0(tmp_path):
    """torchrun's rendezvous orders nodes by address and agent process, not --node-rank:
    when rank 0 ran on node 1, node 0 still reports the restart with the rows node 1
    logged, and every node's next state file holds the same history."""
    import json

    import torch.distributed as dist

    from plait.checkpoint.format import MARKER
    from plait.launch.elastic import Progress
    from plait.launch.nodes import NodeSpec
    from plait.launch.nodes_elastic import KEYS, _agree

    store = dist.PrefixStore(KEYS, dist.HashStore())
    rows = [{"step": s, "loss": 5.0 - s} for s in range(3)]
    store.set("0/failure/0", json.dumps({"rank": 1, "exitcode": 1, "detected_at": 2.0,
                                         "node": 0, "rows": []}))
    store.set("0/failure/1", json.dumps({"rank": 0, "exitcode": -9, "detected_at": 1.0,
                                         "node": 1, "rows": rows}))
    committed = tmp_path / "ck" / "step-00000002"
    committed.mkdir(parents=True)
    (committed / MARKER).touch()
    progress = []
    for node in (0, 1):
        spec = NodeSpec(2, node, 1, "127.0.0.1", 0, "lo", "127.0.0.1")
        (tmp_path / str(node)).mkdir()
        progress.append(Progress(tmp_path / str(node)))
        resume = _agree(store, spec, 1, progress[-1], str(tmp_path / "ck"), 3)
        assert resume == str(committed)
    (restart,) = progress[0].restarts
    assert (restart.rank, restart.last_step, restart.resumed_from) == (0, 2, 2)
    assert restart.lost_steps == 1  # step 2 was logged after the checkpoint of step 2
    assert progress[1].rows == progress[0].rows == rows[:2]
    assert [r.__dict__ for r in progress[1].restarts] == [restart.__dict__]
