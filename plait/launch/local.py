"""Starting and stopping ranks: the process tree of `plait train`, and its signals.

    plait train  (launch_ranks)
      └─ python -m plait.cli _torchrun ... (run_torchrun: torch.distributed.run, quietly)
           └─ python -m plait.train ...   one per rank, each in its own session

A stop is clean whichever process gets the signal. The launcher forwards SIGINT, SIGTERM
or SIGHUP once to torchrun, which passes it to every rank (torch's elastic agent); each
rank raises `StopRequested` at its next Python instruction (with --checkpoint-on-stop: it
only records the signal, and the ranks save and stop together at the next step boundary,
plait/train/stop.py), rank 0 says what happened and at which step, and the run exits
128 + the signal (130 for SIGINT, 143 for SIGTERM).
Should ranks not be gone within `STOP_GRACE_S`, or on a second signal, the launcher kills
the whole tree. A parent that dies, even by SIGKILL, takes its children with it
(PR_SET_PDEATHSIG on Linux), so no rank keeps training as an orphan.

A local run listens on loopback only (`LocalLaunch`, `init_rank_process_group`): left to
itself, torchrun's agent hosts two unauthenticated stores on every interface (the c10d
rendezvous store and one it shares with the workers) and gloo listens on whatever the
hostname resolves to. So the launcher hosts the rendezvous store itself, bound to
127.0.0.1 (`plait.device.network.bound_store`), and the agent joins it as a client
(`--rdzv-conf is_host=false`, `--local-addr 127.0.0.1`); the agent shares no store with
the workers (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`): the ranks build their process group
on the launcher's store (`STORE_ENV`); gloo and NCCL use the loopback interface
(`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`). tests/test_network.py reads every listening
socket of a running job from /proc.

This is the CLI layer (tests/test_layering.py): it installs signal handlers and reads
/proc, which nothing below it does.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from plait.device.network import (
    bound_store,
    loopback_interface,
    process_tree,
    transport_env,
)
from plait.launch.elastic import FAILURE_FILE_ENV, exit_text, write_failure

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 10.0  # ranks stop at their next Python instruction: well within this
TORCHRUN_COMMAND = "_torchrun"  # hidden `python -m plait.cli _torchrun ARGS`
_PR_SET_PDEATHSIG = 1


class StopRequested(BaseException):
    """A stop signal arrived; BaseException so that no `except Exception` swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def exit_with_parent(children_too: bool = False, poll_s: float = 0.5) -> None:
    """The backstop of die_with_parent: a daemon thread that ends this process once its
    parent is gone and a clean stop has had STOP_GRACE_S / 2 (a signal that landed in a
    finalizer is ignored by Python, so the signal alone is not enough)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        time.sleep(STOP_GRACE_S / 2)
        if children_too:
            for p in descendants(os.getpid()):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, signal.SIGKILL)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="plait-exit-with-parent", daemon=True).start()


def raise_on_stop_signals(record: Callable[[int], None] | None = None) -> None:
    """In a rank: the first stop signal raises StopRequested (or, given `record`, is only
    passed to it: --checkpoint-on-stop acts at the next step boundary); a second one
    exits now."""
    def handler(signum: int, frame: object) -> None:
        if getattr(handler, "fired", False):
            os._exit(128 + signum)
        handler.fired = True  # type: ignore[attr-defined]
        if record is not None:
            record(signum)
            return
        raise StopRequested(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (read from /proc; empty where there is none)."""
    return process_tree(pid)[1:]


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it, the leaves first found first."""
    for p in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


@contextlib.contextmanager
def _forwarding(proc: subprocess.Popen, received: list[int]) -> Iterator[None]:
    """While the ranks run, a stop signal is forwarded once; a second one kills all."""
    def handler(signum: int, frame: object) -> None:
        if received:
            kill_tree(proc.pid)
        else:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
        received.append(signum)

    with on_stop_signals(handler):
        yield


@contextlib.contextmanager
def on_stop_signals(handler: Callable[[int, object], None]) -> Iterator[None]:
    """`handler` for SIGINT, SIGTERM and SIGHUP inside the block; the previous ones after."""
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def launch_ranks(cmd: list[str], env: dict[str, str], received: list[int] | None = None
                 ) -> int:
    """Run the torchrun shim until it ends; 128 + signal when stopped by one
    (`received`, if given, gets the stop signals this launcher was sent)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True,  # signals come from us
                            preexec_fn=die_with_parent)
    received = [] if received is None else received
    with _forwarding(proc, received):
        deadline = None
        while proc.poll() is None:
            if received and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                kill_tree(proc.pid)
                print(f"plait: ranks still running {STOP_GRACE_S:.0f} s after "
                      f"{signal_name(received[0])}; killed them", file=sys.stderr, flush=True)
                proc.wait()
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
    if received:
        return 128 + received[0]
    return proc.returncode if proc.returncode in (0, 1, 2) or proc.returncode > 128 else 1


def run_torchrun(argv: list[str]) -> int:
    """torch.distributed.run without its tracebacks: a rank's own message is the report."""
    die_with_parent()
    exit_with_parent(children_too=True)
    # torch's own "sending closing signal" chatter: plait says what happened, once
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # read by torch elastic's get_logger
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun_main

    _shorten_close_grace(STOP_GRACE_S / 2)
    try:
        torchrun_main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except RendezvousError as e:
        # the agent lost the rendezvous store (its host, another node's launcher, went
        # away) while watching its ranks: the job cannot go on; say so in one line
        print(f"plait: lost the job's rendezvous store ({type(e).__name__}): the node "
              "hosting it stopped or is unreachable", file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as e:
        first = min(e.failures.values(), key=lambda f: f.timestamp)  # the root cause
        if os.environ.get(FAILURE_FILE_ENV):  # a restarting launcher reports it (elastic.py)
            write_failure(e.failures, os.environ[FAILURE_FILE_ENV])
        else:
            print(f"plait: rank {first.local_rank} exited first, with "
                  f"{exit_text(first.exitcode)}", file=sys.stderr, flush=True)
        codes = [f.exitcode for f in e.failures.values()]
        # a rank stopped by a signal reports 128 + it; an error in a rank is a failed run
        return max(codes) if codes and min(codes) > 128 else 1
    return 0


def _shorten_close_grace(seconds: float) -> None:
    """After one rank fails, torch's agent stops the others with SIGTERM and a fixed 30 s
    before SIGKILL (PContext.close's default, not its --shutdown-timeout). A stalled rank
    (SIGSTOP, or one that ignores SIGTERM) would hold the job that long after the failure
    was known: give it `seconds`, as a clean stop gets."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close
    if getattr(close, "plait_grace", None) is not None:
        return

    def short_close(self, death_sig=None, timeout: float = seconds) -> None:  # noqa: ANN001
        close(self, death_sig, int(min(timeout, seconds)) or 1)

    short_close.plait_grace = seconds  # type: ignore[attr-defined]
    api.PContext.close = short_close



# what a rank sees when a peer has gone: gloo's text, for the one line a rank prints
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def describe_error(e: BaseException) -> str:
    """An exception as one short line."""
    text = str(e)
    if any(marker in text for marker in PEER_GONE):
        return "lost the connection to another rank (it stopped or failed first)"
    return f"{type(e).__name__}: {text}"


LOCALHOST = "127.0.0.1"


class LocalLaunch:
    """The torchrun command and environment for `nproc` ranks on this machine, and the
    loopback rendezvous store they join (keep this object alive while they run)."""

    def __init__(self, nproc: int, rank_args: list[str], timeout_s: float = 300.0,
                 torchrun: list[str] | None = None, extra: list[str] | None = None,
                 store: dist.TCPStore | None = None, run_id: str = "",
                 interface: tuple[str, str] | None = None):
        """`torchrun`: the command that runs torch.distributed.run (default: the module
        itself); `extra`: more torchrun flags; `store`: a store already hosted, here or on
        another node (several launches share it, each under its own `run_id`);
        `interface`: (name, address) the ranks listen on (default: loopback)."""
        self.store = store or bound_store(LOCALHOST, 0, None,
                                          datetime.timedelta(seconds=timeout_s))
        name, address = interface or (loopback_interface(), LOCALHOST)
        endpoint = f"{self.store.host}:{self.store.port}"
        runner = torchrun or [sys.executable, "-m", "torch.distributed.run"]
        self.command = [
            *runner, "--nnodes=1", *(extra or []),
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id=plait-{os.getpid()}{run_id}",
            "--rdzv-conf=is_host=false", f"--local-addr={address}",
            "-m", "plait.train", *rank_args]
        self.env = {**os.environ, **transport_env(name),
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", STORE_ENV: endpoint}
        # one intra-op thread per rank (docs/architecture.md, Facts)
        self.env.setdefault("OMP_NUM_THREADS", "1")


# host:port of the store `plait train` hosts (LocalLaunch, plait/launch/nodes.py): its ranks
# build their process group on it, so no rank has to bind a port picked by someone else
STORE_ENV = "PLAIT_STORE"
# a multi-node job's attempt (plait/launch/nodes_elastic.py): each builds its group under its
# own prefix of the one store node 0 hosts for the whole job
ATTEMPT_ENV = "PLAIT_ATTEMPT"


def job_store(timeout: datetime.timedelta) -> dist.Store | None:
    """A client of the launcher's store (STORE_ENV), its keys under this attempt's
    restart count; None when not launched by `plait train`."""
    where = os.environ.get(STORE_ENV)
    if not where:
        return None
    host, _, port = where.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    attempt = os.environ.get(ATTEMPT_ENV, "0")
    return dist.PrefixStore(
        f"plait-{attempt}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_rank_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """Join this rank's process group, launched by torchrun. Under `plait train` the
    group is built on the launcher's store (STORE_ENV: already bound, on loopback or the
    named interface). Otherwise, where torchrun's agent shares its store
    (TORCHELASTIC_USE_AGENT_STORE=True, its default) that store is used as is; else rank 0
    hosts the store on MASTER_ADDR:MASTER_PORT only - the master's address on a cluster -
    instead of on every interface. (The agent picks MASTER_PORT free and lets it go: a
    port another process can take before rank 0 binds it.)"""
    env = os.environ
    store = job_store(timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=int(env["RANK"]),
                                world_size=int(env["WORLD_SIZE"]), timeout=timeout)
        return
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
