"""The dimension records (plait/dims/): each names a real setting and flag, the mesh makes
the groups they declare, and a dimension stays in its room (few files name it)."""

import dataclasses
import re
from pathlib import Path

import pytest

from plait.config import Config, ParallelConfig
from plait.dims import (
    AXES,
    CHECKPOINT_ROLES,
    DEFAULT_ORDER,
    DIMENSIONS,
    LAID,
    LOSS_SUMMED,
    REPLICA_AXES,
    REPLICAS,
    SPLITS,
)
from plait.mesh import ParallelMesh
from plait.train.flags import TRAIN_FLAGS

PLAIT = Path(__file__).resolve().parent.parent / "plait"
# files of plait/ that may name a dimension (a word match, comments included): its record,
# the registry, the config field, its strategy, and the planner's places for it
FILES_NAMING = {"cp": 8, "ep": 8}


def test_records_are_complete():
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    for d in DIMENSIONS:
        assert d.name in fields and d.splits in SPLITS and d.checkpoint in CHECKPOINT_ROLES
        assert all(s.key in fields for s in d.settings)
        assert TRAIN_FLAGS[d.name] == f"parallel.{d.name}"
        assert all(TRAIN_FLAGS[s.key] == f"parallel.{s.key}" for s in d.settings)
        assert d.axis or (d.laid_groups and d.laid_ranks is not None), d.name
        __import__(d.strategy)  # the strategy module exists
    assert set(DEFAULT_ORDER) == {d.name for d in AXES}
    assert REPLICAS == "_".join(REPLICA_AXES) and set(LOSS_SUMMED) <= set(DEFAULT_ORDER)


def test_world_size_is_the_product_of_the_axes():
    p = ParallelConfig(**{d.name: i + 2 for i, d in enumerate(DIMENSIONS)})
    world = 1
    for d in AXES:
        world *= getattr(p, d.name)
    assert p.world_size == world


@pytest.mark.parametrize("rank", [0, 5, 11])
def test_mesh_makes_every_declared_group(rank):
    sizes = {"dp": 3, "cp": 2, "tp": 2}
    laid = {d.name: 2 for d in LAID}
    mesh = ParallelMesh.arithmetic(ParallelConfig(**sizes, **laid), rank=rank)
    assert set(mesh.group_ranks) == {*DEFAULT_ORDER, REPLICAS,
                                     *(g for d in LAID for g in d.laid_groups)}
    replicas = mesh.group_ranks[REPLICAS]
    assert len(replicas) == 6 and rank in replicas
    for d in LAID:  # the first and the last (the copies) laid groups tile the replica
        # ranks: rank's groups cross once; any between cut the copies by the first
        first, *between, copies = (mesh.group_ranks[g] for g in d.laid_groups)
        assert set(first) & set(copies) == {rank}
        assert len(first) * len(copies) == len(replicas)
        for group in between:
            assert rank in group and set(group) <= set(copies)


def test_every_dimension_checks_itself():
    for d in DIMENSIONS:
        cfg = Config()
        setattr(cfg.parallel, d.name, 3)  # 3 divides nothing in the default tiny model
        cfg.train.seq_len = 64
        assert d.problems(cfg) or d.name == "dp", f"{d.name}=3 raised no problem"


def test_a_dimension_is_named_in_few_files():
    for name, limit in FILES_NAMING.items():
        word = re.compile(rf"\b{name}\b")
        files = sorted(p.relative_to(PLAIT).as_posix() for p in PLAIT.rglob("*.py")
                       if word.search(p.read_text()))
        assert len(files) <= limit, f"{name} is named in {len(files)} files: {files}"
