"""Live tensor bytes on CPU, measured exactly: a TorchDispatchMode that tracks storages.

CPU has no `max_memory_allocated`, and process RSS is wrong (untouched pages, allocator
reuse). Every tensor a dispatched op *allocates* (a return without alias annotation in the
op's schema: views and in-place results are not new memory) has its storage counted until
that storage is freed (a finalizer on the storage object, which torch keeps unique while
alive). Only storages created inside the mode are counted, so what was alive before (the
parameters, gradients, optimizer state) is excluded: inside a forward pass, `current` after
the forward is the activation memory kept for backward, and `peak` includes transients.

A minimal tracker for tensor/sequence-parallel activation checks; the mode costs 2-3x
step time (DESIGN.md, Facts), so it is for dedicated measurement runs.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """`current` and `peak` bytes of storages allocated while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, tuple) else (out,)
        for ret, value in zip(func._schema.returns, outs, strict=False):
            if ret.alias_info is not None:  # a view or an in-place result: no new memory
                continue
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if key in self._live or nbytes == 0:
            return
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)
