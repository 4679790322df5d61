"""Where a run listens: every rendezvous store and transport socket on the address it names.

The c10d TCPStore's server binds the any-address (`[::]`, every interface) whatever host
it is given, and gloo's transport listens on the address the machine's hostname resolves
to. Neither authenticates a peer, so a run that only asked to be local must not open a
port to the network:

- a store's server here listens on a socket we bind ourselves (`bound_store`: TCPStore's
  `master_listen_fd`), on the host asked for: loopback for a single-node run, the master's
  address for a multi-node one;
- gloo and NCCL take their interface only from `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME`,
  so launchers set them in the ranks' environment (`transport_env`);
- `listening_sockets(pids)` reads the kernel's table of listening TCP sockets
  (/proc/net/tcp, /proc/net/tcp6) and keeps those whose inode one of `pids` holds: what
  the tests check, and what a user can run to see for themselves.

A store on a trusted network is still unauthenticated (as torchrun's documentation says
of its own): multi-node runs belong on a network only the cluster can reach.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

IFF_LOOPBACK = 0x8  # linux/if.h


def loopback_interface() -> str:
    """The name of this machine's loopback interface ("lo" on Linux), from sysfs."""
    for iface in sorted(Path("/sys/class/net").iterdir()):
        try:
            if int((iface / "flags").read_text(), 16) & IFF_LOOPBACK:
                return iface.name
        except (OSError, ValueError):
            continue
    return "lo"


_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def interfaces() -> list[str]:
    """This machine's network interfaces, by name (sysfs)."""
    return sorted(p.name for p in Path("/sys/class/net").iterdir())


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None (no such interface, or none set)."""
    if not name or len(name.encode()) > 15 or "/" in name:  # IFNAMSIZ - 1
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])  # struct ifreq: the name, then a sockaddr_in


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 `address`, or None."""
    for name in interfaces():
        if interface_address(name) == address:
            return name
    return None


def route_to(host: str, port: int) -> str:
    """The local IPv4 address the kernel would send from to reach `host` (a UDP
    "connect" sends nothing; it only picks the route). OSError if there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def transport_env(interface: str) -> dict[str, str]:
    """Environment for ranks so that gloo's and NCCL's sockets use `interface` only."""
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host:port` only (port 0: one the OS picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


def bound_store(host: str, port: int, world_size: int | None,
                timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore server listening on `host:port` only (not on every interface)."""
    sock = listen_socket(host, port)
    # the store owns the descriptor from here on: detach so Python never closes it
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # IPv4 or IPv6 text
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback


def _decode(hex_addr: str) -> tuple[str, int]:
    """/proc/net/tcp{,6} "local_address": host-byte-order 32-bit words in hex, then port."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    # each 4-byte word is little-endian on the machines this runs on (x86, arm64)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port, 16)


def _socket_inodes(pids: list[int]) -> dict[str, int]:
    inodes = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes[link[8:-1]] = pid
    return inodes


def listening_sockets(pids: list[int]) -> list[Listener]:
    """The TCP sockets in LISTEN state held by any of `pids` (Linux /proc)."""
    inodes = _socket_inodes(pids)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                addr, port = _decode(fields[1])
                out.append(Listener(inodes[fields[9]], addr, port))
    return out


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:  # the command may hold spaces or parentheses: fields follow the last ')'
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or unreadable
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out
