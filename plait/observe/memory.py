"""Measured memory by category on CPU: live tensor storages, tracked exactly.

CPU has no `max_memory_allocated`, and process RSS is wrong (untouched pages, allocator
reuse). Instead a `TorchDispatchMode` sees every op's outputs; each new storage is
remembered (weakly) from its first appearance until it is freed. Live bytes are the sum of
the live storages' current sizes, so a storage resized in place (ZeRO-3 frees a gathered
block by resizing its storage to zero) is counted correctly. Storages alive before the
step (parameters, optimizer states) are seeded from the strategy.

Categories come from the strategy at measurement time: `sources()` returns, for
"params", "grads", "optimizer" and "comm", the tensors that currently hold that kind of
state; every other live storage is an activation (or a temporary of the step). The tracker
costs a few times the step's time: it runs in dedicated measuring steps, not every step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("params", "grads", "optimizer", "comm", "activations")
Sources = Callable[[], dict[str, list[torch.Tensor]]]


def _key(st: torch.UntypedStorage) -> int:
    return st._cdata


@dataclass
class MemorySnapshot:
    label: str
    bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


class MemoryTracker(TorchDispatchMode):
    """Exact live tensor bytes per category; peak and labelled samples."""

    def __init__(self, sources: Sources):
        super().__init__()
        self.sources = sources
        self._live: dict[int, weakref.ref] = {}
        self.peak_total = 0
        self.peak: MemorySnapshot = MemorySnapshot("peak")
        self.samples: list[MemorySnapshot] = []
        self._seed()

    # ---- bookkeeping -------------------------------------------------------------------
    def _track(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        k = _key(st)
        if k not in self._live:
            self._live[k] = weakref.ref(st, lambda _, k=k: self._live.pop(k, None))

    def _seed(self) -> None:
        for tensors in self.sources().values():
            for t in tensors:
                self._track(t)

    def live_bytes(self) -> int:
        total = 0
        for ref in list(self._live.values()):
            st = ref()
            if st is not None:
                total += st.nbytes()
        return total

    def breakdown(self, label: str) -> MemorySnapshot:
        """Live bytes now, by category (each storage counted once, first category wins)."""
        seen: set[int] = set()
        out = dict.fromkeys(CATEGORIES, 0)
        for cat, tensors in self.sources().items():
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                k = _key(st)
                if k in seen:
                    continue
                seen.add(k)
                self._track(t)
                out[cat] += st.nbytes()
        for k, ref in list(self._live.items()):
            st = ref()
            if st is not None and k not in seen:
                out["activations"] += st.nbytes()
        return MemorySnapshot(label, out)

    def sample(self, label: str) -> MemorySnapshot:
        snap = self.breakdown(label)
        self.samples.append(snap)
        return snap

    # ---- the dispatch hook -------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        total = self.live_bytes()
        if total > self.peak_total:
            self.peak_total = total
            self.peak = self.breakdown("peak")
        return out
