"""Replica synchronisation (plait/parallel/replicas/): one protocol the loop drives once a
step, chosen once by `parallelize`; the loop names no replica strategy. What each
implementation does end to end is the parity of the layouts (tests/test_matrix.py,
tests/test_hybrid_sharding.py) and of fault-tolerant jobs (tests/test_fault_tolerance.py)."""

import inspect
from pathlib import Path

import torch
import torch.distributed as dist

from plait.config import ParallelConfig, load_config
from plait.mesh import ParallelMesh
from plait.parallel.fault_tolerance import FaultTolerantReplicas
from plait.parallel.replicas.quorum import Quorum
from plait.parallel.replicas.sync import EveryStep, InMesh, ReplicaSync, replica_sync

LOOP = Path(__file__).resolve().parent.parent / "plait" / "train" / "loop.py"


def _protocol() -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in inspect.getmembers(ReplicaSync, inspect.isfunction)
            if not n.startswith("_")}


def test_every_implementation_has_the_protocols_methods():
    assert {"start", "gradients", "after_step", "summary"} <= set(_protocol())
    for cls in (InMesh, EveryStep, Quorum):
        for name, want in _protocol().items():
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(want.parameters), (cls.__name__, name)


def test_the_loop_names_no_replica_strategy():
    """The loop asks the run's replica sync; how replicas meet is theirs."""
    text = LOOP.read_text()
    for needle in ("rows_of", ".slots(", "sum_gradients", "hand_over", "replica_gradients",
                   "held_tensors", ".epoch", ".joining", "fault_tolerance\"", "global_batch ="):
        assert needle not in text, needle


def test_in_mesh_trains_this_ranks_data_parallel_slice_once():
    mesh = ParallelMesh.arithmetic(ParallelConfig(dp=4), 2)
    sync = replica_sync(mesh, 16, optimizer=None, fault_tolerant=None)
    assert isinstance(sync, InMesh) and sync.start() is None and sync.writes()
    asked, trained = [], []
    loss = sync.gradients(3, lambda i, n: asked.append((i, n)) or torch.ones(2),
                          lambda rows: trained.append(rows) or rows.sum())
    assert asked == [(2, 4)] and len(trained) == 1 and float(loss) == 2.0
    assert sync.job_batch() == 16 and sync.summary() == {}


def test_a_fault_tolerant_job_syncs_through_its_quorum():
    mesh = ParallelMesh.arithmetic(ParallelConfig(dp=2), 1)
    ft = FaultTolerantReplicas(dist.HashStore(), 1, 0, 3, mesh, global_batch=12, timeout_s=1.0)
    sync = replica_sync(mesh, 4, optimizer=None, fault_tolerant=ft)
    assert isinstance(sync, Quorum)
    assert sync.job_batch() == 12 and not sync.writes()  # replica 0 is alive: it writes
    progress = {"data": {"global_batch": 4}}
    sync.progress(progress)
    assert progress == {"data": {"global_batch": 12}, "replicas": {"live": 3, "of": 3}}


def test_hybrid_sharding_sums_over_the_group_holding_copies_of_the_shards():
    """Chosen once from the mesh: replica groups laid over ZeRO's shard groups sum every
    step over the group the mesh names as holding the copies; without them, nothing."""
    hybrid = load_config(sets=["parallel.dp=4", "parallel.dp_replicate=2", "parallel.zero=1"])
    mesh = ParallelMesh.arithmetic(hybrid.parallel, 1)
    sync = replica_sync(mesh, 8, optimizer=None, fault_tolerant=None)
    assert type(sync) is EveryStep and sync.group == mesh.shard_groups()[1] is not None
    plain = ParallelMesh.arithmetic(load_config(sets=["parallel.dp=4", "parallel.zero=1"]
                                                ).parallel, 1)
    assert type(replica_sync(plain, 8, optimizer=None, fault_tolerant=None)) is InMesh
