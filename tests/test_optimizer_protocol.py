"""The gradient-sync/optimizer protocol (plait/parallel/optimizer.py): every strategy
make_optimizer returns satisfies it, and the training loop and the checkpoints treat them
all alike (nothing outside plait/parallel/ asks which strategy it has). The behaviour of
each is the parity, ledger and memory tests of test_data_parallel.py, test_zero.py and
test_pipeline_runtime.py (dualpipe), and the checkpoint tests (test_checkpoint*.py)."""

import ast
import importlib
import inspect
import math
import pkgutil
from pathlib import Path

import pytest
import torch
from helpers import config

import plait.parallel
from plait.checkpoint.pieces import states_of
from plait.config import DIMS
from plait.mesh import ParallelMesh
from plait.parallel.held import HeldState
from plait.parallel.optimizer import GradSyncOptimizer, make_optimizer
from plait.parallel.pipeline.partition import build_pipeline
from plait.parallel.replicated import ReplicatedOptimizer, TwoCopyOptimizer
from plait.parallel.zero import ZeroOptimizer
from plait.placement import PlacementTable

DUALPIPE = ("parallel.pp=2", "parallel.schedule=dualpipe", "parallel.microbatches=4",
            "model.n_layers=4")
PLAIT = Path(__file__).resolve().parent.parent / "plait"


def _make(*sets: str):
    """make_optimizer for `sets` as pp rank 0 sees it, and that rank's pipeline parts; a
    mesh without process groups (the strategies communicate only during a step)."""
    cfg = config(*sets)
    mesh = ParallelMesh(sizes={d: getattr(cfg.parallel, d) for d in DIMS}, rank=0)
    mesh.coords = mesh.coords_of(0)
    placements = PlacementTable()
    pipe = build_pipeline(cfg, 0, torch.float32, placements)
    return make_optimizer(pipe.model, mesh, cfg, placements, pipe), pipe


def _made(*sets: str):
    return _make(*sets)[0]


STRATEGIES = [
    ((), ReplicatedOptimizer),
    (("parallel.zero=1",), ZeroOptimizer),
    (("parallel.zero=2", "train.optimizer=sgd", "train.weight_decay=0"), ZeroOptimizer),
    (("parallel.zero=3", "train.precision=bf16"), ZeroOptimizer),
    (DUALPIPE, TwoCopyOptimizer),
    ((*DUALPIPE, "train.optimizer=sgd", "train.weight_decay=0"), TwoCopyOptimizer),
    ((*DUALPIPE, "parallel.zero=2"), ZeroOptimizer),  # ZeRO's units of both copies
]


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(f) for name, f in
            inspect.getmembers(GradSyncOptimizer, inspect.isfunction) if not name.startswith("_")}


def _protocol_members() -> set[str]:
    """Every member: methods, properties (`steps`) and attributes (`mesh`)."""
    props = {n for n, v in vars(GradSyncOptimizer).items() if isinstance(v, property)}
    return set(_protocol_methods()) | props | set(GradSyncOptimizer.__annotations__)


def _optimizer_classes() -> set[type]:
    """Every class of plait/parallel/ that steps an optimizer (`step` and `zero_grad`)."""
    found = set()
    for info in pkgutil.walk_packages(plait.parallel.__path__, "plait.parallel."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == module.__name__ and cls is not GradSyncOptimizer
                    and callable(getattr(cls, "step", None))
                    and callable(getattr(cls, "zero_grad", None))):
                found.add(cls)
    return found


def test_every_optimizer_class_in_parallel_implements_the_protocol():
    classes = _optimizer_classes()
    # each is also made and checked whole below (its attributes exist once constructed)
    assert classes == {cls for _, cls in STRATEGIES}, classes
    assert {"steps", "mesh", "held_states", "params_read_on_load", "finish_load"} <= (
        _protocol_members())
    for cls in classes:
        for name, want in _protocol_methods().items():
            # the same parameter names as the protocol's (isinstance checks only presence)
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(want.parameters), (cls.__name__, name)


@pytest.mark.parametrize("sets, cls", STRATEGIES)
def test_every_strategy_satisfies_the_protocol(sets, cls):
    opt = _made(*sets)
    assert type(opt) is cls
    assert isinstance(opt, GradSyncOptimizer)
    for name in _protocol_members():
        assert hasattr(opt, name), name


@pytest.mark.parametrize("sets, cls", STRATEGIES)
def test_held_states_describe_what_a_checkpoint_reads_and_writes(sets, cls):
    """Each held run is the live tensor of its elements, of the run's states only; the
    update count is the protocol's, and a load sets it."""
    cfg = config(*sets)
    opt, pipe = _make(*sets)
    held = opt.held_states()
    assert held and all(isinstance(h, HeldState) for h in held)
    assert {h.state for h in held} == set(states_of(cfg.train.optimizer))
    for h in held:
        assert h.tensor.dtype == torch.float32
        assert 0 <= h.start < h.stop <= h.param.numel()
        if h.flat:
            assert h.tensor.numel() == h.stop - h.start
        else:
            assert (h.start, h.stop, h.tensor.shape) == (0, h.param.numel(), h.param.shape)
    masters = {h.name for h in held if h.state == "master"}
    copies = {h.name for h in held if h.second_copy}
    assert bool(copies) == ("parallel.schedule=dualpipe" in sets)
    # every owned parameter once (ZeRO with dp = 1: each whole, in one run)
    owned = (pipe.model.owned_parameters() if cfg.parallel.pp > 1
             else list(pipe.model.parameters()))
    assert sum(h.stop - h.start for h in held if h.state == "master" and not h.second_copy
               ) == sum(math.prod(p.shape) for p in owned)
    assert masters >= copies
    read = opt.params_read_on_load()
    assert bool(read) == (cls is ZeroOptimizer and cfg.parallel.zero < 3)
    assert opt.steps == 0
    opt.finish_load(5)
    assert opt.steps == 5


def test_the_loop_has_no_strategy_special_case():
    loop = (Path(__file__).resolve().parent.parent / "plait" / "train" / "loop.py").read_text()
    for needle in ("num_chains", "sum_copy_gradients", "isinstance(", "ZeroOptimizer",
                   "global_grad_norm"):
        assert needle not in loop, needle


def _loop_optimizer_calls() -> set[str]:
    """The methods plait/train/loop.py calls on the optimizer: `opt.x(...)`,
    `par.optimizer.x(...)`, and `opt.x` handed on as a callable."""
    tree = ast.parse((PLAIT / "train" / "loop.py").read_text())
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "opt") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "optimizer"):
                called.add(node.attr)
    return called


def test_the_loop_calls_only_what_the_protocol_declares():
    called = _loop_optimizer_calls()
    assert {"finish_gradients", "step", "zero_grad"} <= called  # the walk sees the calls
    undeclared = called - _protocol_members()
    assert not undeclared, f"declare in GradSyncOptimizer or drop from the loop: {undeclared}"


@pytest.mark.parametrize("sets, cls", STRATEGIES)
def test_replica_gradients_are_the_live_gradients(sets, cls):
    """What replicas sum in place is what the update reads: zeros where there was no
    gradient, and an addition to the returned tensors is seen by `full_grads`."""
    opt = _made(*sets)
    grads = opt.replica_gradients()
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)
    assert opt.replica_gradients()[0] is grads[0]  # the same live tensors, not copies
    for g in grads:
        g += 1.0
    assert all(torch.all(v == 1.0) for v in opt.full_grads().values())


OPTIMIZER_NAMES = {cls.__name__ for _, cls in STRATEGIES}


def _outside_parallel():
    for path in sorted(PLAIT.rglob("*.py")):
        rel = path.relative_to(PLAIT).as_posix()
        if not rel.startswith("parallel/"):
            yield rel, ast.parse(path.read_text())


def _probed(node: ast.AST) -> bool:
    """An expression naming an optimizer object: `opt`, `optimizer`, `x.optimizer`..."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("opt", "optim", "optimizer") or name.endswith("_optimizer")


def test_nothing_outside_parallel_asks_which_optimizer_it_has():
    """Outside plait/parallel/ no module imports an optimizer class, names one (isinstance,
    issubclass, type(...) is ...), or probes an optimizer for attributes (hasattr,
    getattr): the protocol carries what a caller needs."""
    found = []
    for rel, tree in _outside_parallel():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name in OPTIMIZER_NAMES]
            elif isinstance(node, ast.Name) and node.id in OPTIMIZER_NAMES:
                found.append(f"{rel}:{node.lineno} names {node.id}")
            elif isinstance(node, ast.Attribute) and node.attr in OPTIMIZER_NAMES:
                found.append(f"{rel}:{node.lineno} names {node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("hasattr", "getattr", "isinstance", "type")
                  and node.args and _probed(node.args[0])):
                found.append(f"{rel}:{node.lineno} {node.func.id} on an optimizer")
    assert not found, "\n".join(found)
