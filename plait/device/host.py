"""The host's memory as the kernel reports it: what a new process could still take."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def mem_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (the kernel's estimate of memory available
    to new work without swapping, page cache it can drop included); None where there is
    no such file (not Linux) or no such line (kernels before 3.14)."""
    try:
        text = MEMINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            fields = value.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return None
