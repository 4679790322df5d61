"""Ledgered collectives: thin wrappers over torch.distributed, one per op.

Each call names the mesh dim it runs on; the ledger gets op, dim, group size, payload,
the ring-algorithm bytes this rank sends and receives, the link and the wall time. A dim of
size 1 is a no-op with no record. Async calls return a `Handle`; the record is written
when it is waited on, so its time spans issue to completion.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.comm.ledger import ring_bytes

if TYPE_CHECKING:  # the mesh imports the ledger; only types flow this way
    from plait.mesh import ParallelMesh

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


class Handle:
    """An in-flight collective. `wait()` completes it and writes its ledger record."""

    def __init__(self, work: dist.Work | None, record: Callable[[float], None] | None,
                 then: Callable[[], None] | None = None):
        self._work, self._record, self._then, self.done = work, record, then, False
        self.buffers: list[torch.Tensor] = []  # internal buffers alive until wait()

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        if self._then is not None:
            self._then()
        if self._record is not None:
            self._record(time.perf_counter())
        self.done, self.buffers = True, []

    def is_completed(self) -> bool:
        """Has the transfer finished? (Never blocks; `wait()` still writes the record.)"""
        return self.done or self._work is None or self._work.is_completed()


_DONE = Handle(None, None)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _recorder(mesh: ParallelMesh, op: str, dim: str, payload: int, sent: float,
              received: float, tag: str, dtype: torch.dtype, link: str | None = None):
    start = time.perf_counter()
    n = mesh.size(dim)

    def record(end: float) -> None:
        mesh.ledger.add(op, dim, n, payload, sent, received, link or mesh.link(dim), start,
                        tag=tag, dtype=str(dtype).removeprefix("torch."), end=end)

    return record


def _run(work: dist.Work | None, record, async_op: bool,
         then: Callable[[], None] | None = None) -> Handle | None:
    handle = Handle(work, record, then)
    if async_op:
        return handle
    handle.wait()
    return None


def all_reduce(tensor: torch.Tensor, mesh: ParallelMesh, dim: str, op: str = "sum", *,
               via: str = "ring", async_op: bool = False, tag: str = "") -> Handle | None:
    """In-place all-reduce of `tensor` over the group along `dim`.

    via="rs_ag" runs it as reduce-scatter + all-gather (the seeds' identity); the result and
    the total ledger bytes are the same as the ring all-reduce.
    """
    n = mesh.size(dim)
    if n == 1:
        return _DONE if async_op else None
    if via == "rs_ag":
        if async_op:
            raise ValueError("all_reduce(via='rs_ag') is synchronous")
        flat = tensor.reshape(-1)
        padded_len = -(-flat.numel() // n) * n
        buf = torch.zeros(padded_len, dtype=tensor.dtype)
        buf[: flat.numel()] = flat
        shard = torch.empty(padded_len // n, dtype=tensor.dtype)
        reduce_scatter(shard, buf, mesh, dim, op, tag=tag)
        all_gather(buf, shard, mesh, dim, tag=tag)
        flat.copy_(buf[: flat.numel()])
        return None
    if via != "ring":
        raise ValueError(f"all_reduce via={via!r}; use 'ring' or 'rs_ag'")
    payload = _nbytes(tensor)
    sent, recv = ring_bytes("all_reduce", payload, n)
    record = _recorder(mesh, "all_reduce", dim, payload, sent, recv, tag, tensor.dtype)
    work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=mesh.group(dim), async_op=async_op)
    return _run(work, record, async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, mesh: ParallelMesh, dim: str,
                   op: str = "sum", *, async_op: bool = False, tag: str = "") -> Handle | None:
    """`output` (1/n of `input`, flat) gets this rank's reduced shard of `input`."""
    n = mesh.size(dim)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return _DONE if async_op else None
    if input.numel() != output.numel() * n:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, output "
                         f"{output.numel()}; input must be exactly {n} x output")
    payload = _nbytes(input)
    sent, recv = ring_bytes("reduce_scatter", payload, n)
    record = _recorder(mesh, "reduce_scatter", dim, payload, sent, recv, tag, input.dtype)
    group = mesh.group(dim)
    if op == "sum" and dist.get_backend(group) == "gloo":
        # gloo's reduce-scatter runs a whole all-reduce underneath (DESIGN.md, Facts). The
        # direct algorithm sends each rank its chunk from everyone ((n-1)/n of the input,
        # the same bytes as the ring) and sums the n chunks here, in rank order.
        chunks = torch.empty_like(input).reshape(n, -1)
        work = dist.all_to_all_single(chunks, input.reshape(-1), group=group,
                                      async_op=async_op)

        def sum_chunks() -> None:
            torch.sum(chunks, dim=0, out=output.reshape(-1))

        if not async_op:
            sum_chunks()
            record(time.perf_counter())
            return None
        handle = Handle(work, record, then=sum_chunks)
        handle.buffers = [chunks]  # in flight: the owner counts them as communication memory
        return handle
    work = dist.reduce_scatter_single(output, input, op=_REDUCE_OPS[op], group=group,
                                      async_op=async_op)
    return _run(work, record, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, mesh: ParallelMesh, dim: str, *,
               async_op: bool = False, tag: str = "") -> Handle | None:
    """`output` (n x `input`, flat, in rank order along `dim`) gets every rank's `input`."""
    n = mesh.size(dim)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return _DONE if async_op else None
    if output.numel() != input.numel() * n:
        raise ValueError(f"all_gather: output has {output.numel()} elements, input "
                         f"{input.numel()}; output must be exactly {n} x input")
    payload = _nbytes(output)
    sent, recv = ring_bytes("all_gather", payload, n)
    record = _recorder(mesh, "all_gather", dim, payload, sent, recv, tag, input.dtype)
    work = dist.all_gather_single(output, input, group=mesh.group(dim), async_op=async_op)
    return _run(work, record, async_op)


def broadcast(tensor: torch.Tensor, mesh: ParallelMesh, dim: str, src: int = 0, *,
              async_op: bool = False, tag: str = "") -> Handle | None:
    """Broadcast from the rank at coordinate `src` along `dim` (pipelined chain bytes)."""
    n = mesh.size(dim)
    if n == 1:
        return _DONE if async_op else None
    payload = _nbytes(tensor)
    pos = (mesh.coord(dim) - src) % n  # position in the chain that starts at the root
    sent = payload if pos < n - 1 else 0
    recv = payload if pos > 0 else 0
    record = _recorder(mesh, "broadcast", dim, payload, sent, recv, tag, tensor.dtype)
    work = dist.broadcast(tensor, src=mesh.group_ranks[dim][src], group=mesh.group(dim),
                          async_op=async_op)
    return _run(work, record, async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, mesh: ParallelMesh, dim: str,
               output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None, *, async_op: bool = False,
               tag: str = "") -> Handle | None:
    """all_to_all_single along dim 0, even or uneven splits (the MoE dispatch form)."""
    n = mesh.size(dim)
    if n == 1:
        output.copy_(input)
        return _DONE if async_op else None
    me = mesh.coord(dim)
    row_in = _nbytes(input) // max(input.shape[0], 1)
    row_out = _nbytes(output) // max(output.shape[0], 1)
    ins = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
    outs = list(output_split_sizes) if output_split_sizes else [output.shape[0] // n] * n
    sent = (sum(ins) - ins[me]) * row_in
    recv = (sum(outs) - outs[me]) * row_out
    record = _recorder(mesh, "all_to_all", dim, _nbytes(input), sent, recv, tag, input.dtype)
    work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=mesh.group(dim), async_op=async_op)
    return _run(work, record, async_op)


def _p2p_link(mesh: ParallelMesh, peer: int) -> str:
    return "intra" if mesh.node_of(peer) == mesh.node_of(mesh.rank) else "inter"


def send(tensor: torch.Tensor, peer: int, mesh: ParallelMesh, dim: str, *,
         async_op: bool = False, tag: str = "") -> Handle | None:
    """Send to global rank `peer`; `dim` is the mesh dim this transfer belongs to."""
    b = _nbytes(tensor)
    record = _recorder(mesh, "send", dim, b, b, 0, tag, tensor.dtype, _p2p_link(mesh, peer))
    work = dist.isend(tensor, dst=peer) if async_op else dist.send(tensor, dst=peer)
    return _run(work if async_op else None, record, async_op)


def recv(tensor: torch.Tensor, peer: int, mesh: ParallelMesh, dim: str, *,
         async_op: bool = False, tag: str = "") -> Handle | None:
    """Receive from global rank `peer` into `tensor`."""
    b = _nbytes(tensor)
    record = _recorder(mesh, "recv", dim, b, 0, b, tag, tensor.dtype, _p2p_link(mesh, peer))
    work = dist.irecv(tensor, src=peer) if async_op else dist.recv(tensor, src=peer)
    return _run(work if async_op else None, record, async_op)


def batch_send_recv(sends: Sequence[tuple[torch.Tensor, int]],
                    recvs: Sequence[tuple[torch.Tensor, int]], mesh: ParallelMesh, dim: str,
                    *, tag: str = "") -> list[Handle]:
    """Post all sends and receives at once (batch_isend_irecv); one handle per transfer."""
    ops, records = [], []
    for t, peer in sends:
        ops.append(dist.P2POp(dist.isend, t, peer))
        records.append(_recorder(mesh, "send", dim, _nbytes(t), _nbytes(t), 0, tag, t.dtype,
                                 _p2p_link(mesh, peer)))
    for t, peer in recvs:
        ops.append(dist.P2POp(dist.irecv, t, peer))
        records.append(_recorder(mesh, "recv", dim, _nbytes(t), 0, _nbytes(t), tag, t.dtype,
                                 _p2p_link(mesh, peer)))
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    return [Handle(w, r) for w, r in zip(works, records, strict=True)]
