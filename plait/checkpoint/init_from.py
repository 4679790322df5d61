"""Starting weights from elsewhere (`train.init_from`, `--init-from`): a Hugging Face
directory (`hf:DIR`, plait/checkpoint/hf.py), a torch.distributed.checkpoint directory
with torchtitan's names (`dcp:DIR`, plait/checkpoint/dcp.py) or a plait checkpoint (its
fp32 masters only: the optimizer starts fresh at step 0, unlike `--resume`).

The source also defines the model: `initial_model` gives its ModelConfig (config.json,
the model plait's DCP export recorded, or the checkpoint's recorded model), which the
train flags apply below `--set`; a DCP checkpoint without plait's record defines none
(None: the run's own model settings describe it, and `check` holds them to its shapes). `check` is
the preflight: everything a rank will read is there with the right shapes, from headers
and metadata only, before any rank starts. `load_initial` is what each rank runs after
`parallelize`: it reads only the slices it holds (the pieces the checkpoint reader uses).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from plait.config import Config
from plait.mesh import ParallelMesh
from plait.model.presets import ModelConfig
from plait.parallel.parallelize import ParallelModel

from . import dcp, hf
from .format import CheckpointError, read_metadata
from .pieces import initial_pieces
from .reader import candidates, read_pieces


def checkpoint_source(source: str) -> tuple[Path, dict]:
    paths, _ = candidates(Path(source).expanduser())
    return paths[0], read_metadata(paths[0])


def checkpoint_model(meta: dict) -> ModelConfig:
    """The model a checkpoint records (fields this plait does not know are refused)."""
    saved = dict(meta["config"]["model"])
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise CheckpointError(f"the checkpoint's model has fields this plait does not know "
                              f"({', '.join(unknown)})")
    return ModelConfig(**saved)


def initial_model(source: str) -> ModelConfig | None:
    """The model of `source` (hf:DIR, dcp:DIR or a checkpoint; None: a DCP checkpoint that
    records none); CheckpointError if unreadable."""
    directory = hf.hf_dir(source)
    if directory is not None:
        return hf.model_config(directory)
    directory = dcp.dcp_dir(source)
    if directory is not None:
        dcp.read_metadata(directory)  # a missing or foreign directory is refused here
        return dcp.read_record(directory)
    return checkpoint_model(checkpoint_source(source)[1])


def check(source: str, cfg: Config) -> None:
    """Everything `load_initial` will read is there and fits `cfg.model` (headers and
    metadata only); CheckpointError naming the problem."""
    directory = hf.hf_dir(source)
    if directory is not None:
        hf.HFWeights(directory, cfg.model).check()
        return
    directory = dcp.dcp_dir(source)
    if directory is not None:
        dcp.DCPWeights(directory, cfg.model).check()
        return
    path, meta = checkpoint_source(source)
    if checkpoint_model(meta) != cfg.model:
        raise CheckpointError(f"--init-from {path}: the checkpoint is of another model than "
                              "this run's; leave model settings to the checkpoint")


def describe_initial(source: str, model: ModelConfig) -> str:
    """What `load_initial` reads from `source` for `model`, in a line: the resolved source,
    how many tensors, and the training step it records (metadata only)."""
    directory = hf.hf_dir(source)
    if directory is not None:
        return (f"hf:{directory}: {len(hf.weight_names(model))} tensors (a Hugging Face "
                "model: no training step recorded)")
    directory = dcp.dcp_dir(source)
    if directory is not None:
        return f"{dcp.describe_source(directory, model)} (no training step recorded)"
    path, meta = checkpoint_source(source)
    steps = meta["step"]
    return (f"{path}: the masters of {len(meta['tensors'])} tensors, saved after {steps} "
            f"step{'s' * (steps != 1)}")


def load_initial(par: ParallelModel, mesh: ParallelMesh, cfg: Config, source: str) -> None:
    """Fill this rank's part of `par` from `source`; the optimizer restarts at step 0."""
    directory = hf.hf_dir(source)
    if directory is not None:
        hf.load_into(par, mesh, cfg, directory)
        return
    directory = dcp.dcp_dir(source)
    if directory is not None:
        dcp.load_into(par, mesh, cfg, directory)
        return
    path, meta = checkpoint_source(source)
    read_pieces(path, meta, initial_pieces(par, mesh, cfg.train.optimizer))
    par.optimizer.finish_load(0)
