"""All of plait's communication: ledgered collectives (ops), the differentiable ones that
autograd runs (autograd: each a collective forward and its adjoint backward), and the
ledger they write (plait/ledger.py, a layer of its own below the mesh that carries it)
re-exported."""

from plait.comm.ops import (
    Handle,
    all_gather,
    all_reduce,
    all_reduce_on,
    all_to_all,
    batch_send_recv,
    broadcast,
    recv,
    recv_on,
    reduce_scatter,
    send,
    send_on,
)
from plait.ledger import CommRecord, Ledger, ring_bytes

__all__ = ["CommRecord", "Handle", "Ledger", "all_gather", "all_reduce", "all_reduce_on",
           "all_to_all", "batch_send_recv", "broadcast", "recv", "recv_on", "reduce_scatter",
           "ring_bytes", "send", "send_on"]
