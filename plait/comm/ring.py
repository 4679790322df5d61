"""A ring all-gather and a ring reduce-scatter run step by step, so that the caller's
compute on one chunk overlaps the transfer of the next: the collective-matmul
decomposition (Wang et al. 2023, "Overlap communication with dependent computation via
decomposition in large deep learning models", ASPLOS, section 3: an all-gather or a
reduce-scatter becomes n - 1 neighbour exchanges, each beside a partial matmul).

Each hop is a send to the next rank of the ring and a receive from the previous one on
the dim's process group (any backend). The ledger gets one record per decomposed
collective, of the op it replaces (`all_gather`, `reduce_scatter`) with its payload and
ring bytes: the same record, byte for byte, as the undecomposed call (a ring of n - 1
hops of one chunk each *is* the ring algorithm the ledger counts). Its time spans the first
hop's issue to the last hop's completion; its exposed (blocked) part is the sum of the
caller's waits on the hops, so what the partial matmuls hid shows as hidden time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.comm.ops import Handle, _Alias, _nbytes, _recorder
from plait.ledger import ring_bytes

if TYPE_CHECKING:
    from plait.mesh import ParallelMesh


class _Hops:
    """The ledger record of one decomposed collective and the hops that make it up."""

    def __init__(self, op: str, mesh: ParallelMesh, dim: str, payload: int,
                 dtype: torch.dtype, tag: str):
        n = mesh.size(dim)
        self.mesh, self.dim, self.n, self.me = mesh, dim, n, mesh.coord(dim)
        ranks = mesh.group_ranks[dim]
        self.next, self.prev = ranks[(self.me + 1) % n], ranks[(self.me - 1) % n]
        sent, received = ring_bytes(op, payload, n)
        self._record = _recorder(mesh, op, dim, payload, sent, received, tag, dtype)
        self.blocked = 0.0

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> list[Handle]:
        """Post one hop: `send` to the next rank, `recv` filled from the previous one."""
        group = self.mesh.group(self.dim)
        s, r = _Alias(send), _Alias(recv)
        p2p = [dist.P2POp(dist.isend, s.tensor, self.next, group),
               dist.P2POp(dist.irecv, r.tensor, self.prev, group)]
        works = dist.batch_isend_irecv(p2p)
        del p2p  # the handles hold the only references to the aliases
        return [Handle(w, None, aliases=(a,)) for w, a in zip(works, (s, r), strict=True)]

    def wait(self, handles: list[Handle]) -> None:
        entered = time.perf_counter()
        for h in handles:
            h.wait()
        self.blocked += time.perf_counter() - entered

    def close(self) -> None:
        self._record(time.perf_counter(), self.blocked)


def ring_all_gather(chunks: torch.Tensor, mesh: ParallelMesh, dim: str,
                    tag: str = "") -> Iterator[int]:
    """Fill `chunks` (n, ...), whose row `coord(dim)` holds this rank's piece, with every
    rank's piece in rank order. Yields each row's index as soon as that row is here (this
    rank's first, then the previous rank's, and so on round the ring); the caller's work
    between two yields overlaps the next hop."""
    hops = _Hops("all_gather", mesh, dim, _nbytes(chunks), chunks.dtype, tag)
    n = hops.n
    for step in range(n):
        src = (hops.me - step) % n
        pending = hops.exchange(chunks[src], chunks[(src - 1) % n]) if step < n - 1 else []
        yield src
        hops.wait(pending)
    hops.close()


def ring_reduce_scatter(partial: Callable[[int], torch.Tensor], mesh: ParallelMesh,
                        dim: str, tag: str = "",
                        side_work: list[Callable[[], None]] | None = None) -> torch.Tensor:
    """Σ over the ranks of `partial(d)` for d = this rank's coordinate: each rank's
    `partial(d)` is its contribution to chunk d (a fresh contiguous tensor, the same shape
    for every d), computed once per d, the next while the running sum of the previous one
    travels. `side_work`: more work to hide behind the hops, one item a hop, the rest run
    at the end."""
    n, me = mesh.size(dim), mesh.coord(dim)
    work = list(side_work or [])
    acc = partial((me - 1) % n)
    hops = _Hops("reduce_scatter", mesh, dim, n * _nbytes(acc), acc.dtype, tag)
    for step in range(n - 1):
        inbox = torch.empty_like(acc)
        pending = hops.exchange(acc, inbox)
        nxt = partial((me - step - 2) % n)  # hidden behind the hop
        if work:
            work.pop(0)()
        hops.wait(pending)
        acc = nxt + inbox  # not in place: `nxt` may be an output recomputation keeps
    for item in work:
        item()
    hops.close()
    return acc
