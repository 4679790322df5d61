"""Loading under any layout: each rank reads the element ranges it now holds.

After `parallelize` on the new layout, `pieces` says what this rank holds of each
(name, state) as runs of the global flat index; the saved chunks say the same of what
was written; the reader intersects them and reads just those bytes (in whole checksummed
blocks). No collective is needed to read. Bad input is refused from the metadata alone,
identically on every rank, before any collective: a missing directory, no committed
checkpoint, a different model, another optimizer, a step at or past `train.steps`.
A truncated file is found by its size (every rank stats every file: the same answer);
a checksum mismatch only by the rank that reads the block, so one all-reduce (tag
"checkpoint") makes every rank agree to fall back to the previous complete checkpoint,
with a warning, or, for a checkpoint named explicitly, to fail.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np
import torch

from plait import comm
from plait.config import Config
from plait.ledger import OUTSIDE_STEP
from plait.mesh import ParallelMesh
from plait.parallel.parallelize import ParallelModel

from .format import (
    METADATA,
    CheckpointError,
    CorruptCheckpoint,
    VerifiedFile,
    checkpoints,
    chunks_by_tensor,
    global_runs,
    intersect,
    is_committed,
    read_metadata,
    state_dtype,
)
from .pieces import Piece, param_pieces, pieces


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt) and an older one used, or settings differ."""


def candidates(source: str | Path) -> tuple[list[Path], bool]:
    """The checkpoints to try, newest first, and whether `source` named one explicitly
    (then there is no fallback). `source`: a checkpoint directory or a root holding
    `step-N` directories."""
    src = Path(source)
    if not src.exists():
        raise CheckpointError(f"{src}: no such directory")
    if not src.is_dir():
        raise CheckpointError(f"{src} is a file, not a checkpoint directory; name a "
                              "checkpoint (step-N) or the directory that holds them")
    if (src / METADATA).exists() or is_committed(src):
        return [src], True
    found = checkpoints(src)
    done = [p for _, p, ok in found if ok]
    if not found:
        raise CheckpointError(f"{src}: not a checkpoint directory (no step-N inside, no "
                              f"{METADATA}); name a checkpoint or the directory of them")
    if not done:
        extra = f" ({len(found)} uncommitted)"
        raise CheckpointError(f"{src}: no committed checkpoint{extra}; start without "
                              "--resume, or name a checkpoint directory")
    return done, False


def _as_saved(value: object) -> object:
    """A value as JSON gives it back (tuples are lists)."""
    return list(value) if isinstance(value, tuple) else value


def check_compatible(meta: dict, cfg: Config, path: Path) -> None:
    """Refuse a checkpoint this run cannot continue from; warn on training settings that
    differ (the continuation is then not the uninterrupted run)."""
    saved = meta["config"]
    mine = dataclasses.asdict(cfg.model)
    # a field added after the checkpoint was written holds its default there (a checkpoint
    # from before MoE or RoPE scaling is of a model with those off)
    defaults = dataclasses.asdict(type(cfg.model)())
    saved_model = {**{k: v for k, v in defaults.items() if k not in saved["model"]},
                   **saved["model"]}
    diff = sorted(k for k in set(mine) | set(saved_model)
                  if _as_saved(mine.get(k)) != _as_saved(saved_model.get(k)))
    if diff:
        shown = ", ".join(f"{k}: saved {saved_model.get(k)!r}, now {mine.get(k)!r}"
                          for k in diff)
        raise CheckpointError(f"{path}: the checkpoint is of another model ({shown}); resume "
                              "with the same model settings")
    kind = meta["optimizer"]["kind"]
    if kind != cfg.train.optimizer:
        raise CheckpointError(f"{path}: saved with optimizer {kind}, this run uses "
                              f"{cfg.train.optimizer}; set train.optimizer={kind}")
    if meta["step"] >= cfg.train.steps:
        raise CheckpointError(f"{path}: the checkpoint is at step {meta['step']} and "
                              f"train.steps is {cfg.train.steps}: nothing left to train; "
                              "raise --steps")
    def plain(v: object) -> object:  # JSON reads a tuple (recompute_ops) back as a list
        return list(v) if isinstance(v, tuple) else v

    mine_t = dataclasses.asdict(cfg.train)
    changed = [k for k in mine_t if k != "data"  # the same tokens may move
               and plain(saved["train"].get(k)) != plain(mine_t[k])]
    if changed:
        warnings.warn(f"{path}: training settings differ from the checkpoint's "
                      f"({', '.join(changed)}): the run continues, but not as the "
                      "uninterrupted one would", CheckpointWarning, stacklevel=2)


def _files(path: Path, meta: dict) -> dict[str, VerifiedFile]:
    files = {name: VerifiedFile(path / name, e) for name, e in meta["files"].items()}
    for f in files.values():
        f.check_size()
    return files


def read_pieces(path: Path, meta: dict, wanted: list[Piece],
                files: dict[str, VerifiedFile] | None = None) -> None:
    """Fill each piece's live tensor from the checkpoint at `path`."""
    files = _files(path, meta) if files is None else files
    saved = chunks_by_tensor(meta)
    runs: dict[int, tuple] = {}
    for p in wanted:
        shape = tuple(meta["tensors"][p.name]["shape"])
        need = global_runs(shape, p.box_offset, p.box_shape, p.start, p.stop)
        dtype = state_dtype(meta, p.name)
        buf = np.empty(p.stop - p.start, dtype)
        filled = 0
        for c in saved.get((p.name, p.state), []):
            key = id(c)
            if key not in runs:
                runs[key] = global_runs(shape, tuple(c["box_offset"]), tuple(c["box_shape"]),
                                        c["start"], c["stop"])
            pairs = intersect(need, runs[key])
            if not pairs:
                continue
            lo = min(b for _, b, _ in pairs)
            hi = max(b + n for _, b, n in pairs)
            raw = files[c["file"]].read(c["offset"] + dtype.itemsize * (lo - c["start"]),
                                        c["offset"] + dtype.itemsize * (hi - c["start"]))
            data = np.frombuffer(raw, dtype)
            for a, b, n in pairs:
                buf[a - p.start:a - p.start + n] = data[b - lo:b - lo + n]
                filled += n
        if filled != buf.size:
            raise CheckpointError(f"{path}: {p.name} {p.state}: the checkpoint holds {filled} "
                                  f"of the {buf.size} elements this rank needs")
        with torch.no_grad():
            p.tensor.copy_(torch.from_numpy(buf).view(p.tensor.shape))


def _check_tensors(meta: dict, wanted: list[Piece], path: Path) -> None:
    for p in wanted:
        t = meta["tensors"].get(p.name)
        if t is None or p.state not in t.get("states", meta["optimizer"]["states"]):
            raise CheckpointError(f"{path}: has no {p.name} {p.state}")
        if any(o + s > f for o, s, f in zip(p.box_offset, p.box_shape, t["shape"],
                                            strict=True)) or len(t["shape"]) != len(p.box_shape):
            raise CheckpointError(f"{path}: {p.name} is {t['shape']}, this rank holds a "
                                  f"slice {p.box_shape} at {p.box_offset}")


def restore(par: ParallelModel, mesh: ParallelMesh, cfg: Config, source: str | Path
            ) -> tuple[int, Path]:
    """Load the newest complete checkpoint of `source` into this rank's part of `par`;
    returns (the step to continue from, the checkpoint loaded). Every rank calls it."""
    paths, explicit = candidates(source)
    wanted = pieces(par, mesh, cfg.train.optimizer) + param_pieces(par, mesh)
    skipped = []
    for path in paths:
        try:  # the same answer on every rank: metadata and sizes
            meta = read_metadata(path)
            files = _files(path, meta)
        except CorruptCheckpoint as e:
            if explicit:
                raise
            skipped.append(str(e))
            warnings.warn(f"skipping {path}: {e}", CheckpointWarning, stacklevel=2)
            continue
        check_compatible(meta, cfg, path)
        _check_tensors(meta, wanted, path)
        err = None
        try:
            read_pieces(path, meta, wanted, files)
        except CorruptCheckpoint as e:
            err = e
        before, mesh.ledger.step = mesh.ledger.step, OUTSIDE_STEP
        bad = torch.tensor([int(err is not None)], device=mesh.device.torch)
        comm.all_reduce(bad, mesh, "world", op="max", tag="checkpoint")
        mesh.ledger.step = before
        if int(bad):
            msg = str(err) if err is not None else "another rank found a corrupt file"
            if explicit:
                raise CorruptCheckpoint(f"{path}: {msg}")
            skipped.append(msg)
            warnings.warn(f"skipping {path}: {msg}; falling back to an older checkpoint",
                          CheckpointWarning, stacklevel=2)
            continue
        par.optimizer.finish_load(meta["optimizer"]["steps"])
        _restore_rng(meta, mesh)
        return meta["step"], path
    raise CheckpointError(f"{source}: no complete, valid checkpoint ("
                          + "; ".join(skipped) + ")")


def _restore_rng(meta: dict, mesh: ParallelMesh) -> None:
    """On the same layout each rank gets its RNG back (on another, a rank's role differs
    and there is nothing to map it to). plait's training draws no random numbers today
    (data order and init are seeded pure functions of the step and the name), so nothing
    depends on it yet; a strategy that draws (dropout) would."""
    if meta["layout"]["sizes"] != mesh.sizes or meta["layout"]["order"] != list(mesh.order):
        return
    state = meta["rng"][str(mesh.rank)]
    raw = np.frombuffer(base64.b64decode(state["cpu"]), np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    if "cuda" in state and mesh.device.type == "cuda":
        raw = np.frombuffer(base64.b64decode(state["cuda"]), np.uint8).copy()
        torch.cuda.set_rng_state(torch.from_numpy(raw), mesh.device.torch)


def full_tensor(path: Path, meta: dict, name: str, state: str = "master",
                files: dict[str, VerifiedFile] | None = None) -> np.ndarray:
    """One whole tensor (as saved: fp32, or float64 from an fp64 run), read from every
    chunk that holds part of it."""
    shape = tuple(meta["tensors"][name]["shape"])
    out = torch.from_numpy(np.empty(shape, state_dtype(meta, name)))
    full = Piece(name, state, (0,) * len(shape), shape, 0, math.prod(shape), out, False)
    read_pieces(path, meta, [full], files)
    return out.numpy()

