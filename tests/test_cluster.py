"""A cluster on one machine: `plait cluster` runs one `plait train` launcher
per network namespace, the namespaces joined by tbf-shaped veth links on a private bridge
(plait/launch/cluster.py).

The namespace tests need root, `ip`, `tc` and kernel support; `capability_problem()`
tries a throwaway namespace with a shaped veth pair first and they skip with its one-line
reason where that fails. Everything they build carries a unique tag (pid + random) and is
torn down by plait cluster itself; each test then checks that no namespace of that tag
and no process of its run is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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
from plait.cli.main import build_parser
from plait.launch import cluster, cluster_stale
from plait.mesh import ParallelMesh
from plait.testing import assert_parity

pytestmark = pytest.mark.slow  # process trees: `make test-slow`

NO_CLUSTER = cluster.capability_problem()
needs_namespaces = pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
LAYOUT = ("parallel.dp=2", "parallel.tp=2")  # default order: tp inside a node, dp across


def _cluster_args(*argv: str):
    return build_parser().parse_args(["cluster", *argv])


def test_cluster_flags_are_checked_before_anything_is_built():
    args = _cluster_args("--nnodes", "0", "--inter-node-mbit", "-5", "--", "--dp", "2",
                         "--nnodes", "3", "--master=h:1")
    args.train_args = args.train_args[1:]
    problems = cluster.cluster_problems(args)
    assert any("--nnodes 0: choose 1..100" in p for p in problems), problems
    assert any("--inter-node-mbit -5.0: give a rate > 0" in p for p in problems), problems
    assert any(p.startswith("--nnodes after --: plait cluster sets it") for p in problems)
    assert any(p.startswith("--master after --") for p in problems), problems


def test_without_root_or_tools_the_reason_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert cluster.capability_problem() == (
        "emulating nodes needs root (network namespaces, veth, tc): run as root")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool == "tc" else tool)
    assert cluster.capability_problem() == "emulating nodes needs tc (iproute2): install it"
    args = _cluster_args("--inter-node-mbit", "100", "--", "--dp", "2")
    assert cluster.cmd_cluster(args) == 2
    assert capsys.readouterr().err == ("plait: cluster: emulating nodes needs tc (iproute2): "
                                       "install it\n")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _run_cluster(tmp_path: Path, *train_flags: str, steps: int = 2, mbit: int = 1000
                 ) -> tuple[subprocess.CompletedProcess, str, Path]:
    marker = f"plait-cluster-{uuid.uuid4().hex[:12]}"  # in every command line: orphans
    metrics = tmp_path / f"{marker}.jsonl"
    sets = [a for s in (*BASE, *LAYOUT, f"train.steps={steps}") for a in ("--set", s)]
    r = subprocess.run(
        [sys.executable, "-m", "plait.cli", "cluster", "--nnodes", "2", "--inter-node-mbit",
         str(mbit), "--", "--data", str(token_file()), *sets, "--quiet", "--metrics-out",
         str(metrics), "--timeout", "60", *train_flags],
        capture_output=True, text=True, timeout=300)
    tag = re.search(r"plait: cluster (plaitc-\d+-[0-9a-f]+):", r.stderr)
    assert tag, r.stderr
    assert not {n for n in _namespaces() if n.startswith(tag[1])}, "namespaces left"
    assert not list(cluster.NETNS_ETC.glob(f"{tag[1]}*")), "/etc/netns files left"
    assert_all_gone(marker)
    return r, tag[1], metrics


def _wire_sent(stderr: str) -> list[int]:
    m = re.findall(r"node (\d+) sent ([\d,]+) B", stderr)
    return [int(b.replace(",", "")) for _, b in sorted(m)]


@needs_namespaces
def test_two_emulated_nodes_match_the_reference_and_the_wire_matches_the_ledger(tmp_path):
    """2 nodes x 2 ranks (dp=2 across, tp=2 inside): parity with the single-process run
    (fp32 tolerances, docs/parity.md); the ledger marks dp (and the world's scalar
    reductions) inter-node and tp intra-node; and the bytes that left each node's
    interface are the ledger's inter-node bytes of that node's two ranks plus TCP/IP
    headers and the stores' traffic: at least the ledger's, at most 25 % more (the
    headers are 66 B per 1448 B segment, 4.6 %; the stores' a few tens of KiB). Had tp
    crossed the link too, the wire would carry 2.2x the ledger's dp bytes; had the
    ledger marked tp inter-node, it would claim 2.2x what crossed."""
    ck = tmp_path / "ck"
    r, _, metrics = _run_cluster(tmp_path, "--checkpoint-dir", str(ck),
                                 "--checkpoint-every", "2")
    assert r.returncode == 0, r.stderr
    for node in (0, 1):
        assert f"plait: node {node} of 2, 2 ranks: listening on plait0 (10.231.0.10{node})" \
            in r.stderr, r.stderr
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps, summary = rows[:-1], rows[-1]
    assert summary["world_size"] == 4 and summary["config"]["parallel"]["gpus_per_node"] == 2
    path = ck / "step-00000002"
    meta = read_metadata(path)
    params = {n: torch.from_numpy(full_tensor(path, meta, n)) for n in meta["tensors"]}
    assert_parity({"losses": [s["loss"] for s in steps],
                   "grad_norms": [s["grad_norm"] for s in steps], "params": params},
                  reference(*LAYOUT, "train.steps=2"))

    per_step = summary["ledger"]["per_step"]  # rank 0's
    mesh = ParallelMesh(sizes={"dp": 2, "pp": 1, "cp": 1, "tp": 2}, rank=0, gpus_per_node=2)
    mesh.group_ranks = {d: mesh.ranks_along(d) for d in ("dp", "pp", "cp", "tp")}
    assert mesh.link("dp") == "inter" and mesh.link("tp") == "intra"
    for key, row in per_step.items():
        dim = key.split("@")[1]
        inter = dim == "world" or mesh.link(dim) == "inter"
        assert row["sent_inter"] == (row["sent"] if inter else 0.0), (key, row)
    assert {k.split("@")[1] for k in per_step} >= {"dp", "tp"}, per_step
    ledger_inter = 2 * 2 * sum(row["sent_inter"] for row in per_step.values())  # 2 steps,
    for node, sent in enumerate(_wire_sent(r.stderr)):  # 2 ranks a node (symmetric)
        assert ledger_inter <= sent <= 1.25 * ledger_inter, (node, sent, ledger_inter)


def _plan(capsys, *flags: str) -> dict:
    from plait.cli.main import main

    assert main(["plan", "--gpu", "h100-sxm", "--model", "tiny", "--vocab", "256", "--seq",
                 "128", "--gpus", "4", "--gpus-per-node", "2", "--global-batch", "16",
                 "--zero", "0", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["layouts"][0]


def test_the_planner_follows_the_mesh_order_across_nodes(capsys):
    """`plait plan --order`: the mesh's order decides which groups' collectives the
    planner puts on the inter-node link, as ParallelMesh.link does for the ledger."""
    inside = _plan(capsys, "--layout", "tp=2,dp=2")
    across = _plan(capsys, "--layout", "tp=2,dp=2", "--order", "dp,tp,cp,pp")
    links = {name: {(c["dim"], c["link"]) for c in est["collectives"]}
             for name, est in (("inside", inside), ("across", across))}
    assert links["inside"] == {("tp", "nvlink"), ("dp", "inter-node")}, links
    assert links["across"] == {("tp", "inter-node"), ("dp", "nvlink")}, links
    assert across["step_time_s"] > inside["step_time_s"]
    for order in ("dp,tp,cp,pp", "tp,cp,pp,dp"):
        mesh = ParallelMesh(sizes={"dp": 2, "pp": 1, "cp": 1, "tp": 2}, rank=0,
                            order=tuple(order.split(",")), gpus_per_node=2)
        mesh.group_ranks = {d: mesh.ranks_along(d) for d in ("dp", "pp", "cp", "tp")}
        est = inside if order.startswith("tp") else across
        for c in est["collectives"]:
            assert (c["link"] == "inter-node") == (mesh.link(c["dim"]) == "inter"), (order, c)


def _stopped(pids: list[str]) -> bool:
    """Is one of `pids` stopped (SIGSTOP: state T)?"""
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                return True
        except (OSError, IndexError):
            continue
    return False


@needs_namespaces
def test_a_killed_node_comes_back_and_the_job_resumes_from_its_checkpoint(tmp_path):
    """Every process of node 1's namespace SIGKILLed after the
    step-2 checkpoint; plait cluster starts that node's launcher again (as a scheduler
    would), every launcher meets in the next attempt, node 0 picks the newest committed
    checkpoint, and the run finishes: each step once in the metrics, one restart and one
    lost step in the summary, losses and final parameters within the parity tolerances of
    the single-process run (resume is exact: docs/checkpoint.md). When to kill is made
    deterministic by the test-only fault: rank 2 (node 1) SIGSTOPs itself after step 2
    of the first attempt, so the job cannot pass step 3 before the node is killed."""

    marker = f"plait-cluster-{uuid.uuid4().hex[:12]}"
    metrics, ck, err_path = tmp_path / f"{marker}.jsonl", tmp_path / "ck", tmp_path / "err"
    steps = 5
    sets = [a for s in (*BASE, *LAYOUT, f"train.steps={steps}") for a in ("--set", s)]
    code, err, tag = _kill_node_1_once_stopped(
        [*sets, "--quiet", "--metrics-out", str(metrics), "--timeout", "60",
         "--checkpoint-dir", str(ck), "--checkpoint-every", "2"], err_path,
        lambda: (ck / "step-00000002" / "COMMITTED").exists())
    assert code == 0, err
    assert "plait: cluster: node 1 died (SIGKILL); starting it again (1 of 1)" in err, err
    assert re.search(r"plait: restart 1 of 1: .* resuming from step 2 \(checkpoint ", err), err
    assert "Warning" not in err and "Traceback" not in err, err
    assert not {n for n in _namespaces() if n.startswith(tag)}
    assert_all_gone(marker)
    assert_restarted_run_matches(metrics, ck, steps, LAYOUT)


def _kill_node_1_once_stopped(train_flags: list[str], err_path: Path,
                              ready=lambda: True) -> tuple[int, str, str]:
    """`plait cluster --nnodes 2 --max-restarts 1 -- TRAIN FLAGS` with rank 2 (node 1)
    stalling after step 2 (the test-only fault); once it has stopped and `ready()`, every
    process of node 1's namespace SIGKILLed. The exit status, stderr and the cluster's tag
    once the run has ended (240 s at most each)."""
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plait.cli", "cluster", "--nnodes", "2",
             "--inter-node-mbit", "1000", "--max-restarts", "1", "--", "--data",
             str(token_file()), *train_flags], stdout=subprocess.DEVNULL, stderr=err,
            env={**os.environ, "PLAIT_TEST_FAULT": "stop:2:2"})
    try:
        deadline = time.monotonic() + 240
        tag, pids = None, []
        while not ready() or not _stopped(pids):
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, "node 1 did not stop in 240 s"
            time.sleep(0.1)
            found = re.search(r"plait: cluster (plaitc-\d+-[0-9a-f]+):", err_path.read_text())
            tag = found[1] if found else None
            pids = subprocess.run(["ip", "netns", "pids", f"{tag}-n1"], capture_output=True,
                                  text=True).stdout.split() if tag else []
        for pid in pids:  # the whole node: its launcher, its ranks
            subprocess.run(["kill", "-9", pid], check=False)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err_path.read_text(), tag


@needs_namespaces
def test_a_killed_node_s_replica_is_left_out_and_its_node_rejoins(tmp_path):
    """--fault-tolerance across 2 nodes, one replica a node (ZeRO-2 over its 2 ranks): node
    1's rank stalls after step 2 (the test-only fault) and every process of node 1 is then
    SIGKILLed, launcher included, so nobody marks its replica gone: replica 0 leaves it
    out after --replica-timeout and redoes step 3 with its micro-batches, alone; plait
    cluster starts node 1's launcher again, whose replica (generation 1) joins from
    replica 0 over the network before step 4 (--min-replicas 2). Each step once in node
    0's metrics, no step lost, both replicas' final states equal, and losses, grad norms
    and final parameters within the fp32 parity tolerances of the single-process run."""
    marker = f"plait-cluster-{uuid.uuid4().hex[:12]}"
    metrics, ck, err_path = tmp_path / f"{marker}.jsonl", tmp_path / "ck", tmp_path / "err"
    steps = 6
    sets = [a for s in (*BASE, f"train.steps={steps}", "model.tie_embeddings=false")
            for a in ("--set", s)]
    code, err, tag = _kill_node_1_once_stopped(
        [*sets, "--dp-shard", "2", "--dp-replicate", "2", "--zero", "2", "--fault-tolerance",
         "--replica-timeout", "10", "--min-replicas", "2", "--quiet", "--metrics-out",
         str(metrics), "--timeout", "60", "--checkpoint-dir", str(ck), "--checkpoint-every",
         str(steps)], err_path)
    assert code == 0, err
    assert "plait: cluster: node 1 died (SIGKILL); starting it again (1 of 1)" in err, err
    assert "plait: step 3: replica 1 left the quorum after" in err, err
    assert "replica 1 joined from replica 0; 2 of 2 train" in err, err
    assert "Traceback" not in err, err
    assert not {n for n in _namespaces() if n.startswith(tag)}
    assert_all_gone(marker)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    body, ft = rows[:-1], rows[-1]["fault_tolerance"]
    assert [x["step"] for x in body] == list(range(steps)) and body[3]["replicas"] == 1
    assert ft["steps_lost"] == 0 and [e["kind"] for e in ft["events"]] == ["lost", "joined"]
    assert len(ft["state_digests"]) == 2 and len(set(ft["state_digests"].values())) == 1
    path = ck / f"step-{steps:08d}"
    meta = read_metadata(path)
    params = {n: torch.from_numpy(full_tensor(path, meta, n)) for n in meta["tensors"]}
    assert_parity({"losses": [x["loss"] for x in body],
                   "grad_norms": [x["grad_norm"] for x in body], "params": params},
                  reference(f"train.steps={steps}", "model.tie_embeddings=false"))


@needs_namespaces
def test_a_stop_signal_tears_the_cluster_down(tmp_path):
    """SIGTERM to plait cluster while its nodes start: exit 143, and no namespace, no
    /etc/netns file and no process of the run left."""
    import signal

    marker = f"plait-cluster-{uuid.uuid4().hex[:12]}"
    err_path = tmp_path / "err"
    sets = [a for s in (*BASE, *LAYOUT, "train.steps=100000") for a in ("--set", s)]
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plait.cli", "cluster", "--inter-node-mbit", "1000", "--",
             "--data", str(token_file()), *sets, "--quiet", "--metrics-out",
             str(tmp_path / f"{marker}.jsonl")], stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 60
    while not (found := re.search(r"plait: cluster (plaitc-\d+-[0-9a-f]+):",
                                  err_path.read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
        time.sleep(0.1)
    tag = found[1]
    while not subprocess.run(["ip", "netns", "pids", f"{tag}-n1"], capture_output=True,
                             text=True).stdout.split():  # node 1's launcher is in
        assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, err_path.read_text()
    assert "plait: cluster: stopped by SIGTERM; tearing down" in err_path.read_text()
    assert not {n for n in _namespaces() if n.startswith(tag)}
    assert not list(cluster.NETNS_ETC.glob(f"{tag}*"))
    assert_all_gone(marker)



@needs_namespaces
def test_namespaces_a_killed_cluster_left_are_removed_and_no_others(monkeypatch):
    """What plait cluster removes at start (plait/launch/cluster_stale.py): a plait namespace
    whose builder is dead (a process inside is killed, its /etc/netns files go) or whose
    pid now belongs to a process started after the namespace; never a live builder's, nor
    a namespace of another name."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now
    tag = uuid.uuid4().hex[:6]
    stale = f"plaitc-{dead.pid}-{tag}-n0"
    alive = f"plaitc-{os.getpid()}-{tag}-sw"  # this process: started before the namespace
    reused = f"plaitc-{os.getppid()}-{tag}-n1"  # its pid "restarted" (below)
    other = f"notplait-{dead.pid}-{tag}-n0"
    names = (stale, alive, reused, other)
    inside = None
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        (cluster.NETNS_ETC / stale).mkdir(parents=True, exist_ok=True)
        inside = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
        started = cluster_stale._started_at
        monkeypatch.setattr(cluster_stale, "_started_at", lambda pid: time.time() + 60
                            if pid == os.getppid() else started(pid))
        assert cluster_stale.owner_alive(alive) and not cluster_stale.owner_alive(reused)
        ours = sorted([stale, reused])  # (another run's leftovers may go too: dead too)
        assert sorted(n for n in cluster_stale.stale_namespaces() if tag in n) == ours
        assert sorted(n for n in cluster_stale.remove_stale_namespaces() if tag in n) == ours
        assert inside.wait(timeout=10) != 0  # killed with its namespace
        left = _namespaces()
        assert stale not in left and reused not in left and {alive, other} <= left
        assert not (cluster.NETNS_ETC / stale).exists()
        with pytest.raises(ValueError, match="not a plait cluster namespace"):
            cluster_stale.owner_alive(other)
    finally:
        if inside is not None:
            inside.kill()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(cluster.NETNS_ETC / name, ignore_errors=True)
