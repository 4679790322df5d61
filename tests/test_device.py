"""The device seam: which device and backend a rank gets, its timer and memory meter.

CUDA itself is not on this machine: the CUDA branches are checked for what they decide
(device index, backend, the refusal with its fix), and the CPU path for what it runs."""

import subprocess
import sys
import time

import pytest
import torch
from helpers import BASE, token_file

from plait.config import load_config
from plait.device import CPU, Device, DeviceError, resolve_device
from plait.device.memory import CudaMemoryMeter, MemoryTracker
from plait.device.timer import CpuTimer
from plait.mesh import ParallelMesh


def test_cpu_and_auto_without_gpu_resolve_to_cpu_gloo():
    for choice in ("cpu", "auto"):
        d = resolve_device(choice, local_rank=3, cuda_available=False)
        assert d == CPU and d.backend == "gloo" and d.torch == torch.device("cpu")
    # cpu is cpu even where a GPU is visible
    assert resolve_device("cpu", 0, cuda_available=True, cuda_count=8) == CPU


def test_cuda_is_the_local_rank_gpu_with_nccl():
    d = resolve_device("cuda", local_rank=5, cuda_available=True, cuda_count=8)
    assert (d.type, d.index, d.backend) == ("cuda", 5, "nccl")
    assert d.torch == torch.device("cuda", 5) and str(d) == "cuda:5"
    assert resolve_device("auto", 2, cuda_available=True, cuda_count=4) == Device("cuda", 2)


def test_cuda_refused_with_the_fix():
    with pytest.raises(DeviceError, match="use --device cpu"):
        resolve_device("cuda", 0, cuda_available=False)
    with pytest.raises(DeviceError, match="local rank 4 has no GPU .* at most 4 ranks"):
        resolve_device("cuda", 4, cuda_available=True, cuda_count=4)
    with pytest.raises(DeviceError, match="choose one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_cpu_timer_and_meter():
    timer = CPU.timer()
    assert isinstance(timer, CpuTimer)
    a = timer.mark()
    time.sleep(0.01)
    b = timer.mark()
    assert timer.elapsed(a, b) >= 0.01 and timer.seconds(b) == b
    keep = torch.zeros(1000)
    meter = CPU.memory_meter(lambda: {"params": [keep]})
    assert type(meter) is MemoryTracker and not isinstance(meter, CudaMemoryMeter)
    with meter:
        x = torch.ones(250)  # 1000 bytes of activations
        snap = meter.sample("after")
    assert snap.bytes["params"] == 4000 and snap.bytes["activations"] == 1000
    assert meter.allocator_stats() == {}
    del x


def test_mesh_carries_its_device():
    cfg = load_config(None, sets=list(BASE))
    assert ParallelMesh.build(cfg.parallel).device == CPU
    cuda = Device("cuda", 1)
    assert ParallelMesh.build(cfg.parallel, device=cuda).device is cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_train_device_cuda_refused_before_launch(tmp_path):
    out = tmp_path / "m.jsonl"
    r = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--device", "cuda",
                        "--data", str(token_file()), *[a for s in BASE for a in ("--set", s)],
                        "--metrics-out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--device cuda" in r.stderr and "--device cpu" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


# Host-side allocations that are right on the CPU whatever the device: the name-seeded init
# and the RoPE tables are computed on the host (float64 angles) and copied to the device,
# so every device starts from the same bits; the planner, the oracle and the data loader
# never touch a device tensor.
HOST_SIDE = ("plait/model/", "plait/plan/", "plait/train/reference.py", "plait/train/data.py",
             "plait/train/corpus.py", "plait/testing.py")
FACTORIES = {"zeros", "empty", "ones", "full", "tensor", "arange", "randn", "rand",
             "randint", "linspace"}


def test_every_allocation_names_its_device():
    """A factory call without `device=` allocates on the CPU, which on CUDA is a silent
    host round trip or a NCCL error: below the CLI every one must name its device (the
    mesh's, or a tensor's), or be a *_like of a tensor already on it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    missing = []
    for path in sorted((root / "plait").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(HOST_SIDE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and node.func.attr in FACTORIES
                    and not any(k.arg == "device" for k in node.keywords)):
                missing.append(f"{rel}:{node.lineno} torch.{node.func.attr}")
    assert not missing, "allocations that name no device:\n" + "\n".join(missing)
