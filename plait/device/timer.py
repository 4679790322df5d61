"""Timers that measure the device's work, not the host's: one interface, two clocks.

`mark()` takes a point in the order work is issued; `seconds(mark)` turns it into seconds
on one clock shared by every mark of the timer (comparable with `time.perf_counter`, so a
timeline mixes compute marks with the ledger's collective times). `elapsed(a, b)` is the
work between two marks.

On CPU the host runs the kernels: a mark is `perf_counter()`. On CUDA a kernel launch
returns before the kernel runs, so a host clock would time launches; a mark is a CUDA event
recorded on the current stream, resolved (waiting for it) only when read, against an
origin event taken with the host clock at construction.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Timer(Protocol):
    def mark(self) -> Any:
        """A point in the device's work order (cheap; never waits)."""

    def seconds(self, mark: Any) -> float:
        """The mark on this timer's clock, in seconds (may wait for the device)."""

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds of device work between two marks."""


class CpuTimer:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, mark: float) -> float:
        return mark

    def elapsed(self, start: float, end: float) -> float:
        return end - start


class CudaTimer:
    def __init__(self, device: torch.device):
        self.device = device
        torch.cuda.synchronize(device)  # the origin: host clock and stream agree here
        self._origin = self.mark()
        self._origin.synchronize()
        self._origin_host = time.perf_counter()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, mark: torch.cuda.Event) -> float:
        return self._origin_host + self.elapsed(self._origin, mark)

    def elapsed(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
