"""One job over several machines: `plait train --nnodes N --node-rank K --master HOST:PORT
[--interface NAME] [--nproc P]`, one launcher per node (docs/multi_node.md).

    node 0: plait train ... --node-rank 0     hosts the rendezvous store on HOST:PORT
      └─ torchrun's agent (a client of it) └─ P ranks
    node k: plait train ... --node-rank k     joins it
      └─ torchrun's agent                   └─ P ranks

Every listener of a node is bound to one interface's address, never to every interface
(the stores are unauthenticated: they listen only on the job's network): `--interface NAME`,
or else the interface the kernel routes to HOST through.
Node 0's launcher hosts the c10d rendezvous store itself, on that address and PORT
(`plait.device.network.bound_store`); each node's torchrun agent joins it as a client
(`--rdzv-conf is_host=false`, `--local-addr` the node's address), and shares no store with
its ranks; the ranks build their process group on the same store
(`init_rank_process_group`), and gloo / NCCL use the named interface. The stores are
unauthenticated, as torchrun's are: a multi-node job belongs on a network only the
cluster can reach. Each launcher says in one line where it listens.

Global ranks are given out at rendezvous, a node's P ranks contiguous (the nodes in
torch's order: by address, then process); `parallel.gpus_per_node` defaults to P, so the
mesh knows which groups cross nodes. A rank that fails ends its node's agent, which
stops the node's other ranks; the other nodes' ranks lose their peers and end too (gloo
reports the closed connection at once; a stalled peer at `--timeout`); a node whose
launcher is killed takes its ranks with it (plait/launch/local.py). No launcher waits forever:
the rendezvous gives up after `--timeout` seconds.

With `--max-restarts R` every launcher restarts the job together with the others, from
the checkpoint node 0 picks (plait/launch/nodes_elastic.py).

This is the CLI layer.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from dataclasses import dataclass

from plait.device.network import (
    bound_store,
    interface_address,
    interface_of,
    interfaces,
    route_to,
    transport_env,
)
from plait.launch.local import STORE_ENV, launch_ranks

NODE_FLAGS = ("--nnodes", "--node-rank", "--master", "--interface")  # the launcher's only


def add_node_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-node (docs/multi_node.md)")
    g.add_argument("--nnodes", type=int, metavar="N",
                   help="machines in the job, one `plait train` each (default 1)")
    g.add_argument("--node-rank", type=int, metavar="K",
                   help="this machine's index, 0..N-1; node 0 hosts the rendezvous store")
    g.add_argument("--master", metavar="HOST:PORT",
                   help="node 0's address and the port its rendezvous store listens on")
    g.add_argument("--interface", metavar="NAME",
                   help="the network interface every listener of this node binds to "
                   "(default: the one that routes to --master)")


@dataclass(frozen=True)
class NodeSpec:
    nnodes: int
    node_rank: int
    nproc: int  # ranks on this node
    host: str  # the master, as given
    port: int
    interface: str
    address: str  # this node's address on `interface`: every listener's

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc


def _master(text: str | None) -> tuple[str, int] | str:
    """(host, port), or the problem."""
    if not text:
        return "--nnodes > 1 needs --master HOST:PORT (node 0's address and a free port)"
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--master {text}: expected HOST:PORT with a port 1-65535, e.g. node0:29400"
    return host.strip("[]"), int(port)


def _address(args: argparse.Namespace, host: str, port: int) -> tuple[str, str] | str:
    """(interface, its address) this node listens on, or the problem."""
    if args.interface is not None:
        addr = interface_address(args.interface)
        if addr is None:
            return (f"--interface {args.interface}: no such interface with an IPv4 address "
                    f"here (interfaces: {', '.join(interfaces())})")
        return args.interface, addr
    try:
        addr = route_to(host, port)
    except OSError as e:
        return f"--master {host}:{port}: no route to it ({e.strerror or e}); check the host"
    name = interface_of(addr)
    if name is None:
        return f"--master {host}: no interface here holds {addr}; give --interface NAME"
    return name, addr


def node_spec(args: argparse.Namespace, layout_world: int | None
              ) -> tuple[NodeSpec | None, list[str]]:
    """The multi-node flags checked; (None, problems) for a single-node run."""
    for flag in ("nnodes", "node_rank", "master", "interface"):  # plait demo has none
        setattr(args, flag, getattr(args, flag, None))
    nnodes = args.nnodes if args.nnodes is not None else 1
    if nnodes == 1 and args.master is None and args.node_rank in (None, 0):
        if args.interface is not None:
            return None, [f"--interface {args.interface}: a single-node run listens on "
                          "loopback only; --interface is for --nnodes N --master HOST:PORT"]
        return None, []
    problems = []
    if nnodes < 1:
        problems.append(f"--nnodes {nnodes}: must be >= 1")
    rank = args.node_rank
    if rank is None or not 0 <= rank < max(nnodes, 1):
        problems.append(f"--node-rank {rank}: give this machine's index, 0..{nnodes - 1}")
    nproc = args.nproc or ((layout_world or 0) // max(nnodes, 1))
    if nproc < 1 or (args.nproc is None and layout_world and layout_world % nnodes):
        problems.append(f"--nnodes {nnodes}: the layout's {layout_world} ranks do not "
                        "divide over the nodes; give --nproc P (ranks per node)")
    master = _master(args.master)
    if isinstance(master, str):
        return None, [*problems, master]
    where = _address(args, *master)
    if isinstance(where, str):
        return None, [*problems, where]
    if rank == 0 and not problems:
        try:
            resolved = socket.gethostbyname(master[0])
        except OSError:
            resolved = None
        if resolved != where[1]:
            problems.append(f"--master {args.master}: node 0 hosts the store on "
                            f"{where[1]} ({where[0]}), but {master[0]} is {resolved}; run "
                            "node 0 on the master host, or name its interface")
    if problems:
        return None, problems
    return NodeSpec(nnodes, rank, nproc, master[0], master[1], *where), []


class NodeLaunch:
    """The torchrun command and environment for this node's ranks; on node 0 also the
    rendezvous store (keep this object alive while they run)."""

    def __init__(self, spec: NodeSpec, rank_args: list[str], timeout_s: float,
                 torchrun: list[str], extra: list[str], attempt: int | None = None):
        """`attempt`: one attempt of a restarting job (plait/launch/nodes_elastic.py), whose
        launcher hosts the store; its rendezvous is the attempt's own."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = (bound_store(spec.address, spec.port, None, timeout)
                      if spec.node_rank == 0 and attempt is None else None)
        rdzv = f"is_host=false,join_timeout={max(int(timeout_s), 1)}"
        run_id = f"plait-{spec.host}-{spec.port}" + ("" if attempt is None else f"-a{attempt}")
        self.command = [
            *torchrun, f"--nnodes={spec.nnodes}", *extra, f"--nproc-per-node={spec.nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={spec.host}:{spec.port}",
            f"--rdzv-id={run_id}", f"--rdzv-conf={rdzv}",
            f"--local-addr={spec.address}", "-m", "plait.train", *rank_args]
        self.env = {**os.environ, **transport_env(spec.interface),
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                    STORE_ENV: f"{spec.host}:{spec.port}"}  # the ranks' group store too
        self.env.setdefault("OMP_NUM_THREADS", "1")  # docs/architecture.md, Facts

    @staticmethod
    def announce(spec: NodeSpec) -> None:
        hosting = (f"; hosting the rendezvous store on {spec.address}:{spec.port}"
                   if spec.node_rank == 0 else "")
        print(f"plait: node {spec.node_rank} of {spec.nnodes}, {spec.nproc} ranks: listening "
              f"on {spec.interface} ({spec.address}) only{hosting}; master {spec.host}:"
              f"{spec.port}. The stores are unauthenticated: keep them on a network only the "
              "cluster can reach", file=sys.stderr, flush=True)


def run_node(spec: NodeSpec, rank_args: list[str], timeout_s: float, torchrun: list[str],
             extra: list[str]) -> int:
    """Launch this node's ranks and wait for them (plait/launch/local.py: signals, no orphans)."""

    NodeLaunch.announce(spec)
    try:
        launch = NodeLaunch(spec, rank_args, timeout_s, torchrun, extra)
    except OSError as e:  # node 0: the port is taken, or the address is not ours
        print(f"plait: --master {spec.host}:{spec.port}: cannot listen on {spec.address}:"
              f"{spec.port} ({e.strerror or e}); choose another port", file=sys.stderr)
        return 2
    code = launch_ranks(launch.command, launch.env)
    if code == 1:
        print(f"plait: node {spec.node_rank} of {spec.nnodes}: the job failed (a rank here "
              "or on another node); every rank of this node is stopped", file=sys.stderr,
              flush=True)
    return code
