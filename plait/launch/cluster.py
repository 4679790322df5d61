"""A cluster on one machine: `plait cluster --nnodes N --inter-node-mbit M -- TRAIN FLAGS`
(docs/multi_node.md).

    root namespace:  plait cluster (this module: builds, runs, tears down)
    plaitc-<pid>-<tag>-sw      a switch: one bridge, one veth end per node, each shaped
    plaitc-<pid>-<tag>-n<i>    node i: loopback + interface `plait0` (10.231.0.<100+i>/24),
                               shaped; runs `plait train --nnodes N --node-rank i
                               --master 10.231.0.100:29400 --interface plait0`

Each emulated node is a network namespace holding one `plait train` launcher and its
ranks. Ranks of one node reach each other on their own address, which the kernel routes
over the namespace's loopback: fast, unshaped. Every byte between nodes crosses the
node's veth into the switch namespace's bridge and out through the other node's veth;
both ends carry a `tbf` qdisc at `--inter-node-mbit`, so each node has an uplink and a
downlink of that rate (a NIC of that speed on a non-blocking switch). Nothing is built in
the root namespace, and traffic goes only to addresses inside the namespaces built here.

Teardown always runs: at the end, on a failure, on Ctrl-C / SIGTERM / SIGHUP (the
launchers get the signal first, for a clean stop; whatever is left after the grace is
killed, found by namespace: `ip netns pids`), then every namespace is deleted, which
deletes its veths and the bridge. A run's names carry the creating process's pid and a
random tag, so parallel runs do not clash and a leftover says whose it was: a run killed
by SIGKILL leaves its namespaces, and the next `plait cluster` removes those whose builder
is gone (plait/launch/cluster_stale.py).

Rank order: torch's c10d rendezvous orders nodes by address as text, so node i's address
ends in 100 + i (three digits: text order is numeric order) and node i holds global ranks
i*P .. i*P+P-1, as `parallel.gpus_per_node` = P assumes.

Needs root, `ip` and `tc` (iproute2) and a kernel with network namespaces, veth, bridge
and tbf; `capability_problem()` says in one line which is missing (the tests skip with
it). With `--max-restarts R` a node whose launcher dies (every process of the namespace
killed) is started again, as a cluster's scheduler restarts a failed node's task, and it
rejoins the job's next attempt (plait/launch/nodes.py, Restarts).

This is the CLI layer: it starts processes and changes the network configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from plait.launch.cluster_stale import remove_stale_namespaces
from plait.launch.local import die_with_parent, on_stop_signals

SUBNET = "10.231.0"  # inside the run's own namespaces only: no clash with the host's
FIRST_HOST = 100  # node i is SUBNET.(100 + i): text order = numeric order (module doc)
MAX_NODES = 100
MASTER_PORT = 29400  # a fresh namespace: every port is free
NODE_INTERFACE = "plait0"
CLUSTER_FLAGS = ("--nnodes", "--node-rank", "--master", "--interface")  # set per node here
NETNS_ETC = Path("/etc/netns")  # ip-netns(8): per-namespace files for /etc
STOP_GRACE_S = 15.0
FAILED_GRACE_S = 30.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def _tc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=True,
                          timeout=30)


def _why(e: Exception) -> str:
    if isinstance(e, subprocess.CalledProcessError):
        cmd = " ".join(e.cmd)
        return f"`{cmd}` failed: {(e.stderr or e.stdout or '').strip() or e.returncode}"
    return f"{type(e).__name__}: {e}"


def capability_problem() -> str | None:
    """None when this machine can emulate a cluster; else, in one line, why not (tried:
    a throwaway namespace with a veth pair shaped by tbf, deleted again)."""
    if os.geteuid() != 0:
        return "emulating nodes needs root (network namespaces, veth, tc): run as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulating nodes needs {' and '.join(missing)} (iproute2): install it"
    probe = f"plaitc-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _tc("-n", probe, "qdisc", "add", "dev", "pa", "root", *tbf_args(100.0))
    except (OSError, subprocess.SubprocessError) as e:
        return f"this machine cannot emulate nodes: {_why(e)}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def tbf_args(mbit: float) -> list[str]:
    """A tbf qdisc at `mbit`: the bucket at least 64 KiB (a GSO packet's 64 KiB are
    split, never dropped) or 5 ms of the rate; the queue 200 ms of the rate, at least
    1 MiB, so that TCP slows down before tbf drops (a drop costs a retransmit timeout)."""
    rate = mbit * 1e6 / 8  # bytes/s
    burst = max(64 * 1024, int(rate * 0.005))
    limit = max(1 << 20, int(rate * 0.2))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "limit", str(limit)]


@dataclass
class EmulatedCluster:
    """N nodes as namespaces on one switch namespace. Use as a context manager: built on
    entry, every process inside killed and every namespace deleted on exit."""

    nnodes: int
    mbit: float
    tag: str = field(default_factory=lambda: f"plaitc-{os.getpid()}-{secrets.token_hex(3)}")
    built: list[str] = field(default_factory=list)  # namespaces, in creation order

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def namespace(self, node: int) -> str:
        return f"{self.tag}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{FIRST_HOST + node}"

    @property
    def master(self) -> str:
        return f"{self.address(0)}:{MASTER_PORT}"

    def node_flags(self, node: int) -> list[str]:
        """The `plait train` flags that put a launcher on node `node`."""
        return ["--nnodes", str(self.nnodes), "--node-rank", str(node),
                "--master", self.master, "--interface", NODE_INTERFACE]

    def __enter__(self) -> EmulatedCluster:
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.built.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        self._name_files(name)

    def _name_files(self, name: str) -> None:
        """`ip netns exec` mounts /etc/netns/NAME/* over /etc: every node's address and
        this host's name in `hosts`, and a resolver on the namespace's own loopback, so
        that a name lookup (torch logs a client's host name) answers at once instead of
        timing out on a name server the namespace cannot reach. Best effort: where /etc
        is read-only, lookups are only slower."""
        etc = NETNS_ETC / name
        nodes = "".join(f"{self.address(n)} plait-node{n}\n" for n in range(self.nnodes))
        with contextlib.suppress(OSError):
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n{nodes}")
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")

    def _build(self) -> None:
        sw = self.switch
        self._add_namespace(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for node in range(self.nnodes):
            ns, port = self.namespace(node), f"sw{node}"
            self._add_namespace(ns)
            _ip("link", "add", NODE_INTERFACE, "netns", ns, "type", "veth",
                "peer", "name", port, "netns", sw)
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", NODE_INTERFACE)
            for where, dev in ((ns, NODE_INTERFACE), (sw, port)):  # uplink and downlink
                _tc("-n", where, "qdisc", "add", "dev", dev, "root", *tbf_args(self.mbit))
                _ip("-n", where, "link", "set", dev, "up")

    def run(self, node: int, argv: list[str], **popen: object) -> subprocess.Popen:
        """Start `argv` inside node `node`'s namespace; it dies with this process."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *argv],
                                preexec_fn=die_with_parent, **popen)  # type: ignore[call-overload]

    def pids(self, node: int) -> list[int]:
        """Every process in node `node`'s namespace."""
        out = _ip("netns", "pids", self.namespace(node), check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_node(self, node: int) -> list[int]:
        """SIGKILL every process of node `node` (a machine that died); the pids killed."""
        killed = self.pids(node)
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def wire_bytes(self, node: int) -> dict[str, int]:
        """Bytes node `node` sent and received between nodes (its interface's counters)."""
        out = _ip("-n", self.namespace(node), "-s", "-j", "link", "show", NODE_INTERFACE)
        stats = json.loads(out.stdout)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def teardown(self) -> None:
        """Kill what runs inside, delete every namespace (their veths and the bridge go
        with them). Safe to call twice."""
        for _ in range(50):  # a process may fork while we kill: until none is left
            left = [n for n in range(self.nnodes) if self.namespace(n) in self.built
                    and self.kill_node(n)]
            if not left:
                break
            time.sleep(0.1)
        for name in reversed(self.built):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        self.built.clear()


# ---- the command -----------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster", help="emulate N nodes on this machine (network namespaces, shaped links) "
        "and train across them", description="A cluster on one machine: `plait cluster "
        "--nnodes N --inter-node-mbit M -- TRAIN FLAGS` runs plait train across N emulated "
        "nodes (network namespaces, links shaped to M Mbit/s; docs/multi_node.md).",
        epilog="everything after -- goes to every node's `plait train` (not --nnodes, "
        "--node-rank, --master, --interface: set per node). Needs root, ip and tc.")
    p.add_argument("--nnodes", type=int, default=2, metavar="N", help="nodes (default 2)")
    p.add_argument("--inter-node-mbit", type=float, required=True, metavar="M",
                   help="each node's link to the switch, both directions, in Mbit/s")
    p.add_argument("--max-restarts", type=int, metavar="R",
                   help="a node that dies is started again and the job resumes from its "
                   "last committed checkpoint, up to R times (passed to every node)")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="-- then the `plait train` flags of every node")
    p.set_defaults(func=cmd_cluster)


def cluster_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if not 1 <= args.nnodes <= MAX_NODES:
        problems.append(f"--nnodes {args.nnodes}: choose 1..{MAX_NODES}")
    if not args.inter_node_mbit > 0:
        problems.append(f"--inter-node-mbit {args.inter_node_mbit}: give a rate > 0")
    if args.max_restarts is not None and args.max_restarts < 0:
        problems.append(f"--max-restarts {args.max_restarts}: give 0 or more")
    for flag in CLUSTER_FLAGS + ("--max-restarts",):
        if any(a == flag or a.startswith(flag + "=") for a in args.train_args):
            problems.append(f"{flag} after --: plait cluster sets it for every node; give "
                            "plait cluster's own flags before --")
    return problems


def cmd_cluster(args: argparse.Namespace) -> int:
    train = args.train_args[1:] if args.train_args[:1] == ["--"] else list(args.train_args)
    args.train_args = train
    problems = cluster_problems(args)
    if problems:
        print("plait: cannot start the cluster:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    problem = capability_problem()
    if problem:
        print(f"plait: cluster: {problem}", file=sys.stderr)
        return 2
    removed = remove_stale_namespaces()  # a run killed by SIGKILL could not tear down
    if removed:
        print(f"plait: cluster: removed {len(removed)} namespaces a killed plait cluster "
              f"left: {', '.join(removed)}", file=sys.stderr, flush=True)
    restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
    command = [sys.executable, "-m", "plait.cli", "train", *train, *restarts]
    cluster = EmulatedCluster(args.nnodes, args.inter_node_mbit)
    try:
        with _signals_raise(), cluster:
            print(f"plait: cluster {cluster.tag}: {args.nnodes} nodes, links "
                  f"{args.inter_node_mbit:g} Mbit/s each way, master {cluster.master}",
                  file=sys.stderr, flush=True)
            code = run_nodes(cluster, lambda node: [*command, *cluster.node_flags(node)],
                             args.max_restarts or 0)
            print(wire_line(cluster), file=sys.stderr, flush=True)
            return code
    except ClusterStop as stop:  # a second signal while stopping: teardown has run
        return 128 + stop.signum
    except (OSError, subprocess.SubprocessError) as e:  # building the network failed
        print(f"plait: cluster: {_why(e)}", file=sys.stderr)
        return 1


def wire_line(cluster: EmulatedCluster) -> str:
    """What crossed each node's link, from its interface's counters (all of it: the
    training's collectives, the stores, TCP/IP headers)."""
    parts = []
    for node in range(cluster.nnodes):
        wire = cluster.wire_bytes(node)
        parts.append(f"node {node} sent {wire['tx']:,} B, received {wire['rx']:,} B")
    return "plait: cluster: between nodes: " + "; ".join(parts)


class ClusterStop(BaseException):
    def __init__(self, signum: int):
        self.signum = signum


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """A stop signal becomes ClusterStop, so that teardown runs."""
    def handler(signum: int, frame: object) -> None:
        raise ClusterStop(signum)

    with on_stop_signals(handler):
        yield


def run_nodes(cluster: EmulatedCluster, command: Callable[[int], list[str]],
              max_restarts: int) -> int:
    """One launcher per node until all end; the job's exit status (the first non-zero).
    A launcher killed by a signal is started again while restarts are left."""
    procs = {n: cluster.run(n, command(n)) for n in range(cluster.nnodes)}
    codes: dict[int, int] = {}
    restarted, failed_at = 0, None
    try:
        while len(codes) < len(procs):
            for node, proc in procs.items():
                if node in codes or proc.poll() is None:
                    continue
                # a node died (node 0 hosts the job's store: its loss ends the job)
                if proc.returncode < 0 and node > 0 and restarted < max_restarts:
                    restarted += 1
                    print(f"plait: cluster: node {node} died "
                          f"({signal.Signals(-proc.returncode).name}); starting it again "
                          f"({restarted} of {max_restarts})", file=sys.stderr, flush=True)
                    procs[node] = cluster.run(node, command(node))
                    continue
                codes[node] = proc.returncode
            failed_at = _end_the_rest(procs, codes, failed_at)
            time.sleep(0.1)
    except ClusterStop as stop:
        return _stop_nodes(procs, stop.signum)
    failed = [c for c in codes.values() if c != 0]
    code = failed[0] if failed else 0
    return 128 + -code if code < 0 else code


def _end_the_rest(procs: dict[int, subprocess.Popen], codes: dict[int, int],
                  failed_at: float | None) -> float | None:
    """Once a node has failed, the others get FAILED_GRACE_S to end on their own (they
    normally do within seconds: their ranks lose their peers), then SIGTERM, as SLURM's
    --kill-on-bad-exit; a node waiting for a peer that will not come is not left waiting
    out its timeout. The time of the first failure, or None."""
    if failed_at is None:
        return time.monotonic() if any(c != 0 for c in codes.values()) else None
    if time.monotonic() - failed_at > FAILED_GRACE_S:
        for node, proc in procs.items():
            if node not in codes and proc.poll() is None:
                print(f"plait: cluster: node {node} still running {FAILED_GRACE_S:.0f} s "
                      "after another failed; stopping it", file=sys.stderr, flush=True)
                proc.send_signal(signal.SIGTERM)
        return float("inf")  # once
    return failed_at


def _stop_nodes(procs: dict[int, subprocess.Popen], signum: int) -> int:
    """Forward the stop to every launcher (a clean stop); teardown kills what is left."""
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    print(f"plait: cluster: stopped by {signal.Signals(signum).name}; tearing down",
          file=sys.stderr, flush=True)
    return 128 + signum
