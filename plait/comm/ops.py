"""Ledgered collectives: thin wrappers over torch.distributed, one per op.

Each call names the mesh dim it runs on; the ledger gets op, dim, group size, payload,
the ring-algorithm bytes this rank sends and receives, the link, the wall time and the
part of it the caller was blocked (exposed: all of a synchronous call; for an async one,
its time inside `Handle.wait()`). A dim of size 1 is a no-op with no record. Async calls
return a `Handle`; the record is written at issue, in the issuing step, and timed when it
is waited on, so its time spans issue to completion, and what is not exposed was hidden
behind the caller's other work.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.ledger import ring_bytes

if TYPE_CHECKING:  # the mesh imports the ledger; only types flow this way
    from plait.mesh import ParallelMesh

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}
# the single-tensor collectives: torch 2.12 named them all_gather_single and
# reduce_scatter_single (pytorch/pytorch#186123) and deprecated all_gather_into_tensor and
# reduce_scatter_tensor; torch 2.11 has only the old names (docs/gpu.md, "torch 2.11")
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


class Handle:
    """An in-flight collective. `wait()` completes it and times its ledger record.

    `aliases`: the tensor objects handed to the backend (fresh aliases of the caller's
    tensors, see `_Alias`). On gloo the worker thread keeps its references to a finished
    work's tensors for a moment after marking it complete; had it the last reference, a
    buffer would be freed at a random later time on that thread, and a memory measurement
    would depend on thread scheduling (docs/zero.md, "Deterministic lifetimes"). `wait()`
    returns once the backend holds none of them: every release happens on the program's
    thread, where the program says.
    """

    def __init__(self, work: dist.Work | None, record: Callable[[float], None] | None,
                 then: Callable[[], None] | None = None,
                 aliases: Sequence[_Alias] = ()):
        self._work, self._record, self._then, self.done = work, record, then, False
        self._aliases = list(aliases)
        self.buffers: list[torch.Tensor] = []  # internal buffers alive until wait()

    def wait(self, issued_blocking: bool = False) -> None:
        """Complete the collective. The time spent in here is what the caller was blocked
        by it (its exposed time); `issued_blocking`: the call itself was synchronous, so
        all of it, from issue, was exposed."""
        if self.done:
            return
        entered = time.perf_counter()
        if self._work is not None:
            self._work.wait()
            self._work = None
            _await_release(self._aliases)
        self._aliases = []
        if self._then is not None:
            self._then()
        if self._record is not None:
            end = time.perf_counter()
            self._record(end, None if issued_blocking else end - entered)
        self.done, self.buffers = True, []

    def is_completed(self) -> bool:
        """Has the transfer finished? (Never blocks; `wait()` still writes the record.)"""
        return self.done or self._work is None or self._work.is_completed()


class _Alias:
    """A new tensor object over the caller's storage: the one handed to the backend, so
    that the backend's references to it can be counted (see Handle)."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t.detach()
        self._py_refs = sys.getrefcount(self.tensor)  # this attribute's, and the call's

    def held_by_backend(self) -> bool:
        # While C++ holds a tensor, torch keeps its Python object alive with an extra
        # Python reference; the backend drops that one last, on its own thread, once it
        # gets the GIL. Both counts back to ours: the backend is done with it.
        return self.tensor._use_count() > 1 or sys.getrefcount(self.tensor) > self._py_refs


# A finished gloo work is let go within microseconds (measured: at most a few ms with 8
# ranks on 2 cores). The bound guards against a backend that keeps its works: past it we
# stop waiting, and nothing else changes.
RELEASE_TIMEOUT_S = 5.0


def _await_release(aliases: list[_Alias]) -> None:
    """Yield until the backend holds no reference to the aliases (CPU tensors only: NCCL's
    watchdog thread keeps a work's tensors until the GPU has run it, so waiting for
    their release would block the host on the device inside the step; the CUDA caching
    allocator orders a buffer's reuse after the stream that used it, whoever frees it)."""
    aliases = [a for a in aliases if not a.tensor.is_cuda]
    deadline = None
    while any(a.held_by_backend() for a in aliases):
        now = time.monotonic()
        deadline = deadline or now + RELEASE_TIMEOUT_S
        if now > deadline:
            return
        time.sleep(0)  # yields the GIL to the worker thread that is releasing the work


_DONE = Handle(None, None)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _recorder(mesh: ParallelMesh, op: str, dim: str, payload: int, sent: float,
              received: float, tag: str, dtype: torch.dtype, link: str | None = None,
              sent_inter: float | None = None, group_size: int | None = None):
    start = time.perf_counter()
    n = mesh.size(dim) if group_size is None else group_size
    entry = mesh.ledger.enter(op, dim, payload, tag)  # the flight recorder
    # the record is the issuing step's, written at issue (its bytes are known then) and
    # timed at completion: a collective waited on in a later step (ZeRO-1/2's parameter
    # all-gathers, completed before each unit's next forward) counts in the step it serves
    rec = mesh.ledger.add(op, dim, n, payload, sent, received, link or mesh.link(dim), start,
                          tag=tag, dtype=str(dtype).removeprefix("torch."), end=start,
                          blocked=0.0, sent_inter=sent_inter)

    def record(end: float, blocked: float | None = None) -> None:
        """`blocked`: seconds the caller waited in `wait()`; None: a synchronous call,
        blocked from issue to completion."""
        entry.done = True
        rec.end, rec.blocked = end, end - start if blocked is None else blocked

    return record


def _run(issue: Callable[[], dist.Work], record, async_op: bool,
         aliases: Sequence[_Alias] = ()) -> Handle | None:
    """Every op is issued asynchronously to torch (`issue()`); a synchronous call waits
    here, so that sync and async calls release their buffers the same way. The handle
    holds the only reference to the work (no caller's frame does), so that the backend's
    release of it can be observed in Handle.wait()."""
    handle = Handle(issue(), record, aliases=aliases)
    if async_op:
        return handle
    handle.wait(issued_blocking=True)
    return None


def all_reduce(tensor: torch.Tensor, mesh: ParallelMesh, dim: str, op: str = "sum", *,
               via: str = "ring", async_op: bool = False, tag: str = "") -> Handle | None:
    """In-place all-reduce of `tensor` over the group along `dim`.

    via="rs_ag" runs it as reduce-scatter + all-gather (the identity of
    Stanford CS336, lecture 8); the result and
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
        buf = torch.zeros(padded_len, dtype=tensor.dtype, device=tensor.device)
        buf[: flat.numel()] = flat
        shard = torch.empty(padded_len // n, dtype=tensor.dtype, device=tensor.device)
        reduce_scatter(shard, buf, mesh, dim, op, tag=tag)
        all_gather(buf, shard, mesh, dim, tag=tag)
        flat.copy_(buf[: flat.numel()])
        return None
    if via != "ring":
        raise ValueError(f"all_reduce via={via!r}; use 'ring' or 'rs_ag'")
    payload = _nbytes(tensor)
    sent, recv = ring_bytes("all_reduce", payload, n)
    record = _recorder(mesh, "all_reduce", dim, payload, sent, recv, tag, tensor.dtype)
    a = _Alias(tensor)
    return _run(lambda: dist.all_reduce(a.tensor, op=_REDUCE_OPS[op], group=mesh.group(dim),
                                        async_op=True), record, async_op, aliases=(a,))


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
        # gloo's reduce-scatter runs a whole all-reduce underneath (docs/architecture.md,
        # Facts). The direct algorithm sends each rank its chunk from everyone ((n-1)/n of
        # the input, the same bytes as the ring) and sums the n chunks here, in rank order.
        chunks = torch.empty_like(input).reshape(n, -1)
        o, i = _Alias(chunks), _Alias(input.reshape(-1))
        work = dist.all_to_all_single(o.tensor, i.tensor, group=group, async_op=True)

        def sum_chunks() -> None:
            torch.sum(chunks, dim=0, out=output.reshape(-1))

        handle = Handle(work, record, then=sum_chunks, aliases=(o, i))
        del work  # the handle holds the only reference (see _run)
        if not async_op:
            handle.wait()
            return None
        handle.buffers = [chunks]  # in flight: the owner counts them as communication memory
        return handle
    o, i = _Alias(output), _Alias(input)
    return _run(lambda: _REDUCE_SCATTER_SINGLE(o.tensor, i.tensor, op=_REDUCE_OPS[op],
                                               group=group, async_op=True),
                record, async_op, aliases=(o, i))


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
    o, i = _Alias(output), _Alias(input)
    return _run(lambda: _ALL_GATHER_SINGLE(o.tensor, i.tensor, group=mesh.group(dim),
                                           async_op=True), record, async_op, aliases=(o, i))


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
    a = _Alias(tensor)
    root = mesh.group_ranks[dim][src]
    return _run(lambda: dist.broadcast(a.tensor, src=root, group=mesh.group(dim), async_op=True),
                record, async_op, aliases=(a,))


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
    # per peer: the splits to ranks on other nodes (what node-limited routing saves)
    node = mesh.node_of(mesh.rank)
    peers = mesh.group_ranks.get(dim, list(range(mesh.world_size)))
    inter = sum(k for k, peer in zip(ins, peers, strict=True)
                if mesh.node_of(peer) != node) * row_in
    record = _recorder(mesh, "all_to_all", dim, _nbytes(input), sent, recv, tag, input.dtype,
                       sent_inter=inter)
    o, i = _Alias(output), _Alias(input)
    return _run(lambda: dist.all_to_all_single(o.tensor, i.tensor, output_split_sizes,
                                               input_split_sizes, group=mesh.group(dim),
                                               async_op=True), record, async_op, aliases=(o, i))


def all_reduce_on(tensor: torch.Tensor, group: dist.ProcessGroup, dim: str,
                  mesh: ParallelMesh, link: str, *, async_op: bool = False,
                  tag: str = "") -> Handle | None:
    """In-place sum of `tensor` over `group`, a process group outside the mesh's (the
    quorum of fault-tolerant replicas, plait/parallel/fault_tolerance.py), ledgered on
    `mesh` under `dim` with the group's own size and `link`."""
    n = group.size()
    payload = _nbytes(tensor)
    sent, recv_ = ring_bytes("all_reduce", payload, n)
    record = _recorder(mesh, "all_reduce", dim, payload, sent, recv_, tag, tensor.dtype, link,
                       group_size=n)
    a = _Alias(tensor)
    return _run(lambda: dist.all_reduce(a.tensor, group=group, async_op=True), record,
                async_op, aliases=(a,))


def send_on(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, dim: str,
            mesh: ParallelMesh, link: str, *, tag: str = "") -> None:
    """Send to rank `peer` of `group` (outside the mesh's groups, as `all_reduce_on`)."""
    b = _nbytes(tensor)
    record = _recorder(mesh, "send", dim, b, b, 0, tag, tensor.dtype, link,
                       group_size=group.size())
    a = _Alias(tensor)
    _run(lambda: group.send([a.tensor], peer, 0), record, False, aliases=(a,))


def recv_on(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, dim: str,
            mesh: ParallelMesh, link: str, *, tag: str = "") -> None:
    """Receive from rank `peer` of `group` into `tensor` (as `send_on`)."""
    b = _nbytes(tensor)
    record = _recorder(mesh, "recv", dim, b, 0, b, tag, tensor.dtype, link,
                       group_size=group.size())
    a = _Alias(tensor)
    _run(lambda: group.recv([a.tensor], peer, 0), record, False, aliases=(a,))


def _p2p_link(mesh: ParallelMesh, peer: int) -> str:
    return "intra" if mesh.node_of(peer) == mesh.node_of(mesh.rank) else "inter"


def send(tensor: torch.Tensor, peer: int, mesh: ParallelMesh, dim: str, *,
         async_op: bool = False, tag: str = "") -> Handle | None:
    """Send to global rank `peer`; `dim` is the mesh dim this transfer belongs to."""
    b = _nbytes(tensor)
    record = _recorder(mesh, "send", dim, b, b, 0, tag, tensor.dtype, _p2p_link(mesh, peer))
    a = _Alias(tensor)
    return _run(lambda: dist.isend(a.tensor, dst=peer), record, async_op, aliases=(a,))


def recv(tensor: torch.Tensor, peer: int, mesh: ParallelMesh, dim: str, *,
         async_op: bool = False, tag: str = "") -> Handle | None:
    """Receive from global rank `peer` into `tensor`."""
    b = _nbytes(tensor)
    record = _recorder(mesh, "recv", dim, b, 0, b, tag, tensor.dtype, _p2p_link(mesh, peer))
    a = _Alias(tensor)
    return _run(lambda: dist.irecv(a.tensor, src=peer), record, async_op, aliases=(a,))


def batch_send_recv(sends: Sequence[tuple[torch.Tensor, int]],
                    recvs: Sequence[tuple[torch.Tensor, int]], mesh: ParallelMesh, dim: str,
                    *, tag: str = "") -> list[Handle]:
    """Post all sends and receives at once (batch_isend_irecv); one handle per transfer."""
    ops, records, aliases = [], [], []
    for t, peer in sends:
        aliases.append(_Alias(t))
        ops.append(dist.P2POp(dist.isend, aliases[-1].tensor, peer))
        records.append(_recorder(mesh, "send", dim, _nbytes(t), _nbytes(t), 0, tag, t.dtype,
                                 _p2p_link(mesh, peer)))
    for t, peer in recvs:
        aliases.append(_Alias(t))
        ops.append(dist.P2POp(dist.irecv, aliases[-1].tensor, peer))
        records.append(_recorder(mesh, "recv", dim, _nbytes(t), 0, _nbytes(t), tag, t.dtype,
                                 _p2p_link(mesh, peer)))
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    del ops  # the P2POps hold the aliases too: only the handles may
    return [Handle(w, r, aliases=(a,)) for w, r, a in zip(works, records, aliases, strict=True)]
