"""The device seam: where this rank computes and how its collectives travel.

One `Device` is resolved once, in the CLI layer, from `--device auto|cpu|cuda` and the
launcher's local rank, and is carried by the `ParallelMesh` (`mesh.device`); everything
below allocates on `mesh.device.torch`, times with `mesh.device.timer()` and measures
memory with `mesh.device.memory_meter(...)`. Nothing below the CLI asks torch which
device exists: on this seam a run on CPU/gloo and one on CUDA/NCCL run the same code.

- CPU: backend gloo; timing by `time.perf_counter` (the host runs the kernels, so wall
  time is compute time); memory by `MemoryTracker` (exact live tensor storages).
- CUDA: backend NCCL; device `cuda:LOCAL_RANK`; timing by CUDA events recorded on the
  current stream (`perf_counter` would measure kernel *launches*, which return at once);
  memory by the same tracker plus the caching allocator's own statistics
  (`torch.cuda.max_memory_allocated`, `max_memory_reserved`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.device.memory import CudaMemoryMeter, MemoryTracker, Sources
from plait.device.timer import CpuTimer, CudaTimer, Timer

CHOICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """A device request this machine cannot honour; the message names what to change."""


@dataclass(frozen=True)
class Device:
    type: str = "cpu"  # "cpu" | "cuda"
    index: int | None = None  # the CUDA device of this rank (its local rank)

    @property
    def torch(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else \
            torch.device(self.type)

    @property
    def backend(self) -> str:
        """The torch.distributed backend whose collectives run on this device."""
        return "nccl" if self.type == "cuda" else "gloo"

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    def activate(self) -> None:
        """Make this the current device of the process (NCCL binds a rank to one GPU)."""
        if self.is_cuda:
            torch.cuda.set_device(self.torch)

    def synchronize(self) -> None:
        """Wait for the work issued so far on this device (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.torch)

    def timer(self) -> Timer:
        return CudaTimer(self.torch) if self.is_cuda else CpuTimer()

    def memory_meter(self, sources: Sources | None = None) -> MemoryTracker:
        """Measured memory by category for a measuring step (see plait/device/memory.py)."""
        if self.is_cuda:
            return CudaMemoryMeter(self.torch, sources)
        return MemoryTracker(sources)

    def peak_memory(self) -> tuple[int, str]:
        """This process's peak memory so far, cheaply, and what the number is: on CUDA the
        caching allocator's peak of allocated tensor bytes; on CPU the process's peak
        resident set (the interpreter and torch included: an upper bound on the tensors,
        which only the measuring step's tracker counts exactly)."""
        if self.is_cuda:
            return torch.cuda.max_memory_allocated(self.torch), "peak allocated"
        import resource  # POSIX; Linux reports KiB

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"

    def __str__(self) -> str:
        return str(self.torch)


CPU = Device("cpu")


def resolve_device(choice: str, local_rank: int = 0, cuda_available: bool | None = None,
                   cuda_count: int | None = None) -> Device:
    """The device for `--device choice` on the rank with this local rank.

    auto: CUDA when torch sees a GPU, else CPU. cuda: `cuda:local_rank`, refused with the
    fix when this torch build or machine has no GPU for that rank. `cuda_available` and
    `cuda_count` default to what torch reports (tests pass them)."""
    if choice not in CHOICES:
        raise DeviceError(f"--device {choice!r}: choose one of {', '.join(CHOICES)}")
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if choice == "cpu" or (choice == "auto" and not available):
        return CPU
    if not available:
        build = "a CPU-only build" if torch.version.cuda is None else \
            f"built for CUDA {torch.version.cuda}, but no GPU is visible"
        raise DeviceError(f"--device cuda: torch {torch.__version__} is {build}; use "
                          "--device cpu (or auto), or install a CUDA build of torch")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if local_rank >= count:
        raise DeviceError(f"--device cuda: local rank {local_rank} has no GPU (this machine "
                          f"shows {count}); launch at most {count} ranks per node "
                          "(--nproc / torchrun --nproc-per-node)")
    return Device("cuda", local_rank)


__all__ = ["CHOICES", "CPU", "Device", "DeviceError", "MemoryTracker", "Timer",
           "resolve_device"]
