"""Data parallel: every rank holds the whole model and a slice of the global batch.

Gradients of the loss (sum over local tokens / tokens in the global batch) are summed
across dp, which gives exactly the single-process gradient of the global mean loss.

- naive:    after the last micro-batch's backward, all-reduce each gradient in turn.
- bucketed: gradients are packed, in the order backward produces them, into buckets of
            about `bucket_mb`; a bucket is all-reduced asynchronously as soon as it is full,
            overlapping the rest of backward; `finish()` waits and unpacks. The first
            bucket is capped at FIRST_BUCKET_MB (torch DDP's convention,
            `dist._DEFAULT_FIRST_BUCKET_BYTES`): the first all-reduce starts with the
            head's gradient instead of waiting for a whole bucket, so a model smaller than
            one bucket still overlaps communication with backward.
Only the last micro-batch of a step communicates (earlier ones just accumulate).
"""

from __future__ import annotations

import torch
from torch import nn

from plait import comm
from plait.comm.ops import Handle
from plait.config import FIRST_BUCKET_MB
from plait.mesh import ParallelMesh
from plait.parallel.buckets import backward_runs


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.handle: Handle | None = None


class DataParallel:
    """Gradient synchronisation over the mesh's dp dim for the parameters of `model`."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, mode: str = "bucketed",
                 bucket_mb: float = 25.0, dim: str = "dp",
                 params: list[nn.Parameter] | None = None):
        """`params`: the parameters this sync covers (default: all of `model`'s; expert
        parallel gives its slices to a sync over "edp")."""
        if mode not in ("naive", "bucketed"):
            raise ValueError(f"data parallel mode {mode!r}; use 'naive' or 'bucketed'")
        self.mesh, self.mode, self.dim = mesh, mode, dim
        self.params = ([p for p in model.parameters() if p.requires_grad] if params is None
                       else list(params))
        self.sync = True
        self.buckets: list[_Bucket] = []
        self._hooks = []
        if mode == "bucketed" and mesh.size(dim) > 1:
            self._build_buckets(bucket_mb)

    def _build_buckets(self, bucket_mb: float) -> None:
        # backward produces gradients roughly in reverse order of registration
        sizes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = [_Bucket([self.params[i] for i in run]) for run in backward_runs(
            sizes, bucket_mb * 2**20, min(FIRST_BUCKET_MB, bucket_mb) * 2**20)]
        self._where = {id(p): (i, j) for i, b in enumerate(self.buckets)
                       for j, p in enumerate(b.params)}
        self._next_launch = 0
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # ---- bucketed -------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        i, j = self._where[id(p)]
        self.buckets[i].ready.add(j)
        # launch in bucket order on every rank, so collectives match across ranks
        while (self._next_launch < len(self.buckets)
               and len(self.buckets[self._next_launch].ready)
               == len(self.buckets[self._next_launch].params)):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        bucket.handle = comm.all_reduce(bucket.flat, self.mesh, self.dim, async_op=True,
                                        tag="grads")

    # ---- the step's protocol ----------------------------------------------------------
    def before_backward(self, last_microbatch: bool) -> None:
        """Call before each micro-batch's backward; only the last one communicates."""
        self.sync = last_microbatch

    def finish(self) -> None:
        """After the last backward: gradients are summed over dp when this returns."""
        if self.mesh.size(self.dim) == 1:
            return
        if self.mode == "naive":
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, self.mesh, self.dim, tag="grads")
            return
        # buckets whose parameters got no gradient this step still take part, with zeros
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for b in self.buckets:
            b.handle.wait()
            offset = 0
            for p in b.params:
                n = p.numel()
                reduced = b.flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = reduced.clone()
                else:
                    p.grad.copy_(reduced)
                offset += n
            b.ready.clear()
            b.flat, b.handle = None, None
        self._next_launch = 0
