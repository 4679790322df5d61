"""Launching ranks so that a local run listens only on loopback (CLI layer).

`plait train --nproc N` starts N ranks on this machine through torchrun
(`torch.distributed.run`). Left to itself, torchrun's agent hosts two unauthenticated
stores on every interface (the c10d rendezvous store and a store it shares with the
workers), and gloo listens on whatever the hostname resolves to. For a single-node run:

- the launcher hosts the rendezvous store itself, bound to 127.0.0.1
  (`plait.device.network.bound_store`), and tells the agent to join it as a client
  (`--rdzv-conf is_host=false`), naming 127.0.0.1 as its address (`--local-addr`);
- the agent shares no store with the workers (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`;
  torchrun's documentation also recommends it for restarts); instead rank 0 hosts the
  process group's store on `MASTER_ADDR:MASTER_PORT` only (`init_rank_process_group`);
- gloo and NCCL use the loopback interface (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`).

tests/test_network.py reads every listening socket of a running job from /proc.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from plait.device.network import bound_store, loopback_interface, transport_env

LOCALHOST = "127.0.0.1"


class LocalLaunch:
    """The torchrun command and environment for `nproc` ranks on this machine, and the
    loopback rendezvous store they join (keep this object alive while they run)."""

    def __init__(self, nproc: int, rank_args: list[str], timeout_s: float = 300.0):
        self.store = bound_store(LOCALHOST, 0, None, datetime.timedelta(seconds=timeout_s))
        self.command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={LOCALHOST}:{self.store.port}", f"--rdzv-id=plait-{os.getpid()}",
            "--rdzv-conf=is_host=false", f"--local-addr={LOCALHOST}",
            "-m", "plait.train", *rank_args]
        self.env = {**os.environ, **transport_env(loopback_interface()),
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        # one intra-op thread per rank (docs/architecture.md, Facts)
        self.env.setdefault("OMP_NUM_THREADS", "1")


def init_rank_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """Join this rank's process group, launched by torchrun. Where torchrun's agent shares
    its store (TORCHELASTIC_USE_AGENT_STORE=True, its default) that store is used as is;
    otherwise rank 0 hosts the store on MASTER_ADDR:MASTER_PORT only - loopback for a
    local run, the master's address on a cluster - instead of on every interface."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or "MASTER_ADDR" not in env:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    if rank == 0:
        store = bound_store(host, port, world, timeout)
    else:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timeout)
