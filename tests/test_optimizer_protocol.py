"""The gradient-sync/optimizer protocol (plait/parallel/optimizer.py): every strategy
make_optimizer returns satisfies it, and the training loop treats them all alike. The
behaviour of each is the parity, ledger and memory tests of test_data_parallel.py,
test_zero.py and test_pipeline_runtime.py (dualpipe)."""

import inspect
from pathlib import Path

import pytest
import torch
from helpers import config

from plait.config import DIMS
from plait.mesh import ParallelMesh
from plait.parallel.optimizer import GradSyncOptimizer, make_optimizer
from plait.parallel.pipeline.partition import build_pipeline
from plait.parallel.replicated import ReplicatedOptimizer, TwoCopyOptimizer
from plait.parallel.zero import ZeroOptimizer
from plait.placement import PlacementTable

DUALPIPE = ("parallel.pp=2", "parallel.schedule=dualpipe", "parallel.microbatches=4",
            "model.n_layers=4")


def _made(*sets: str):
    """make_optimizer for `sets` as pp rank 0 sees it; a mesh without process groups (the
    strategies communicate only during a step)."""
    cfg = config(*sets)
    mesh = ParallelMesh(sizes={d: getattr(cfg.parallel, d) for d in DIMS}, rank=0)
    mesh.coords = mesh.coords_of(0)
    placements = PlacementTable()
    pipe = build_pipeline(cfg, 0, torch.float32, placements)
    return make_optimizer(pipe.model, mesh, cfg, placements, pipe)


@pytest.mark.parametrize("sets, cls", [
    ((), ReplicatedOptimizer),
    (("parallel.zero=1",), ZeroOptimizer),
    (("parallel.zero=2", "train.optimizer=sgd", "train.weight_decay=0"), ZeroOptimizer),
    (("parallel.zero=3", "train.precision=bf16"), ZeroOptimizer),
    (DUALPIPE, TwoCopyOptimizer),
])
def test_every_strategy_satisfies_the_protocol(sets, cls):
    opt = _made(*sets)
    assert type(opt) is cls
    assert isinstance(opt, GradSyncOptimizer)
    # same parameter names as the protocol's methods (isinstance checks only presence)
    for name, method in inspect.getmembers(GradSyncOptimizer, inspect.isfunction):
        if name.startswith("_"):
            continue
        want = list(inspect.signature(method).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == want, name


def test_zero_with_two_copies_is_refused_by_the_factory():
    with pytest.raises(ValueError, match="DualPipe"):
        _made(*DUALPIPE, "parallel.zero=1")


def test_the_loop_has_no_strategy_special_case():
    loop = (Path(__file__).resolve().parent.parent / "plait" / "train" / "loop.py").read_text()
    for needle in ("num_chains", "sum_copy_gradients", "isinstance(", "ZeroOptimizer",
                   "global_grad_norm"):
        assert needle not in loop, needle
