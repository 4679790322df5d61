"""Namespaces a killed `plait cluster` left behind, found and removed (docs/multi_node.md).

`plait cluster` names everything it builds `plaitc-<pid>-<tag>-<role>` (plait/launch/cluster.py:
the pid of the process that built it, six hex digits of tag, `sw`, `n<i>` or `probe`).
Teardown runs at every end it can catch; SIGKILL it cannot, and then the namespaces (and
the bridge and veths inside them) stay. At start, `plait cluster` removes those whose
builder is gone: a namespace of exactly that form whose pid is dead, or whose pid now
belongs to a process started after the namespace was (the pid was reused). A namespace
of any other name is never touched, nor one whose builder still runs (a parallel run).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

NAME = re.compile(r"plaitc-(?P<pid>\d+)-[0-9a-f]{6}-(?:sw|n\d+|probe)")
NETNS_RUN = Path("/run/netns")  # ip-netns(8): where named namespaces are mounted
NETNS_ETC = Path("/etc/netns")
CLOCK_SLACK_S = 1.0  # /proc's boot time is in whole seconds


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def namespaces() -> list[str]:
    """Every named network namespace (`ip netns list`, first word of each line)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _started_at(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text()
                    .splitlines() if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    ticks = float(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def owner_alive(name: str) -> bool:
    """Whether the process that built plait namespace `name` still runs (its pid alive
    and started before the namespace was made)."""
    match = NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name} is not a plait cluster namespace")
    started = _started_at(int(match["pid"]))
    if started is None:
        return False
    try:
        made = (NETNS_RUN / name).stat().st_ctime  # the namespace's inode: made with it
    except OSError:
        return True  # cannot tell when it was made: leave it
    return started <= made + CLOCK_SLACK_S


def stale_namespaces() -> list[str]:
    """plait's namespaces whose builder is gone."""
    return [n for n in namespaces() if NAME.fullmatch(n) and not owner_alive(n)]


def remove_stale_namespaces() -> list[str]:
    """Kill what still runs inside each stale plait namespace and delete it (its veths
    and bridge go with it) and its /etc/netns files; the names removed."""
    removed = []
    for name in stale_namespaces():
        for _ in range(20):  # a process may fork while we kill
            pids = [int(p) for p in _ip("netns", "pids", name).stdout.split() if p.isdigit()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if _ip("netns", "del", name).returncode == 0:
            removed.append(name)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    return removed
