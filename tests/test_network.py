"""A local run listens only on loopback: no unauthenticated port open to the network.

Every listening TCP socket of a running job is read from the kernel's tables
(/proc/net/tcp, /proc/net/tcp6, matched to the processes' socket inodes) while it runs."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from helpers import BASE, token_file

from plait.device.network import _decode, listening_sockets, process_tree
from plait.launch.forked import run_ranks


def test_decode_proc_net_addresses():
    assert _decode("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _decode("00000000:0016") == ("0.0.0.0", 22)
    assert _decode("00000000000000000000000000000000:A37B") == ("::", 0xA37B)
    assert _decode("00000000000000000000000001000000:0050") == ("::1", 80)
    assert _decode("0000000000000000FFFF00000100007F:0050") == ("::ffff:127.0.0.1", 80)


def _own_listeners(rank, world):
    t = torch.ones(2)
    dist.all_reduce(t)  # the transport is up
    dist.barrier()
    out = [(s.address, s.port, s.loopback) for s in listening_sockets([os.getpid()])]
    dist.barrier()
    return out


def test_harness_ranks_listen_on_loopback_only():
    per_rank = run_ranks(_own_listeners, 3)
    assert all(per_rank), per_rank  # every rank listens (gloo), rank 0 also for the store
    assert len(per_rank[0]) >= 2
    exposed = [s for r in per_rank for s in r if not s[2]]
    assert not exposed, f"listening beyond loopback: {exposed}"


@pytest.mark.slow  # a launched process tree
def test_plait_train_listens_on_loopback_only(tmp_path):
    out = tmp_path / "m.jsonl"
    sets = [a for s in BASE + ["train.steps=100000"] for a in ("--set", s)]
    job = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "train", "--nproc", "2", "--dp", "2",
         "--data", str(token_file()), *sets, "--metrics-out", str(out), "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        partial = out.with_name(out.name + ".partial")  # streamed there until the end
        while not (partial.exists() and partial.read_text().count("\n") >= 2):  # all up
            assert job.poll() is None, job.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the job did not start training in 120 s"
            time.sleep(0.2)
        pids = process_tree(job.pid)
        found = listening_sockets(pids)
        assert len(pids) >= 4  # launcher, torchrun's agent, two ranks
        assert len({s.pid for s in found}) >= 3, found  # launcher's store, each rank's gloo
        exposed = [s for s in found if not s.loopback]
        assert not exposed, f"listening beyond loopback: {exposed}"
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
