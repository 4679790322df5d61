"""Saving: every rank writes what it holds into a temporary directory; rank 0 commits.

The protocol (three small all-reduces over the world, ledger tag "checkpoint", outside
the training step):
1. rank 0 creates `D/step-N.tmp-<token>`; the all-reduced token tells every rank the
   name (or, -1, that it could not be created: every rank raises the same error);
2. every rank writes its pieces (plait/checkpoint/pieces.py) and its manifest; the
   all-reduced failure flags tell every rank who failed (a full disk is an OSError);
3. rank 0 merges the manifests into `metadata.json`, checks that the pieces tile every
   tensor, writes the `COMMITTED` marker, fsyncs and renames the directory to `step-N`:
   the rename is the commit (POSIX rename is atomic), so a crash at any point leaves
   either the previous checkpoints alone or the new one complete. Only then does `keep`
   delete older checkpoints (and dead attempts' temporary directories).
A failed save raises `CheckpointError` on every rank and leaves the committed ones.
A background save (--async-checkpoint) runs step 2's file writes on a thread from a host
copy of the pieces; its step-2 agreement and step 3 run at `PendingSave.commit()`, on the
main thread of every rank (no collective runs off it).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path

import torch

from plait import comm
from plait.config import Config
from plait.ledger import OUTSIDE_STEP
from plait.mesh import ParallelMesh
from plait.model.precision import wide_dtype
from plait.model.transformer import build_model
from plait.muon import muon_states
from plait.parallel.expert import moe_layers
from plait.parallel.parallelize import ParallelModel, model_dtype

from .format import (
    BLOCK,
    FORMAT,
    MARKER,
    METADATA,
    CheckpointError,
    RankWriter,
    check_coverage,
    checkpoints,
    fsync_dir,
    rank_file,
    step_dir,
    write_json,
)
from .pieces import pieces, states_of


def plait_version() -> str:
    try:
        return importlib_metadata.version("plait")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def save(par: ParallelModel, mesh: ParallelMesh, cfg: Config, root: Path, step: int,
         progress: dict | None = None, keep: int | None = None, background: bool = False
         ) -> Path | PendingSave:
    """Save the state after `step` completed steps under `root`; collective over the world
    (every rank calls it). Returns the committed directory; with `background`, a
    `PendingSave` whose files are being written by a thread from a host copy of the
    state, to be `commit()`ted later by every rank (training may go on meanwhile)."""
    root = Path(root)
    with _outside_step(mesh):
        tmp = _make_tmp(mesh, root, step)
        snap = _snapshot(par, mesh, cfg, copy=background)
    progress = {**(progress or {}), "optimizer_steps": par.optimizer.steps}
    pending = PendingSave(mesh, cfg, tmp, root, step, progress, keep)
    if not background:
        pending.write(*snap)
        return pending.commit()
    pending.thread = threading.Thread(target=pending.write, args=snap, daemon=True,
                                      name=f"checkpoint-{step}")
    pending.thread.start()
    return pending


@contextmanager
def _outside_step(mesh: ParallelMesh):
    before, mesh.ledger.step = mesh.ledger.step, OUTSIDE_STEP  # not the step's bytes
    try:
        yield
    finally:
        mesh.ledger.step = before


def _agree(mesh: ParallelMesh, values: list[int]) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=mesh.device.torch)
    comm.all_reduce(t, mesh, "world", tag="checkpoint")
    return [int(x) for x in t.tolist()]


def _make_tmp(mesh: ParallelMesh, root: Path, step: int) -> Path:
    token, err = 0, ""
    if mesh.rank == 0:
        token = (os.getpid() * 1_000_003 + time.time_ns()) % (1 << 40) + 1
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / f"{step_dir(root, step).name}.tmp-{token}").mkdir()
        except OSError as e:
            token, err = -1, f"{e.strerror or e} ({e.filename or root})"
    token = _agree(mesh, [token])[0]
    if token == -1:
        raise CheckpointError(f"checkpoint step {step}: cannot create a directory in {root}"
                              f"{': ' + err if err else ' (see rank 0)'}; check the path "
                              "and its permissions")
    return root / f"{step_dir(root, step).name}.tmp-{token}"


def saved_dtype(cfg: Config) -> torch.dtype:
    """What the states are saved in: the masters' and moments' dtype, float64 for a float64
    model (its resume continues exactly), else fp32."""
    return wide_dtype(model_dtype(cfg))


def _snapshot(par: ParallelModel, mesh: ParallelMesh, cfg: Config, copy: bool
              ) -> tuple[list[tuple[dict, torch.Tensor]], dict]:
    """This rank's pieces to write (chunk metadata, fp32 host tensor) and its RNG state.
    `copy`: host copies that later steps cannot change (a background write); otherwise
    views where the state is already on the host (written before training resumes)."""
    out, saved = [], saved_dtype(cfg)
    for p in pieces(par, mesh, cfg.train.optimizer):
        if p.write:
            host = p.tensor.detach().reshape(-1).to(device="cpu", dtype=saved, copy=copy)
            out.append(({"name": p.name, "state": p.state, "box_offset": list(p.box_offset),
                         "box_shape": list(p.box_shape), "start": p.start, "stop": p.stop},
                        host))
    rng = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if mesh.device.type == "cuda":
        rng["cuda"] = base64.b64encode(
            torch.cuda.get_rng_state(mesh.device.torch).numpy().tobytes()).decode()
    return out, rng


@dataclass
class PendingSave:
    """A save between its files and its commit. `write` runs on this rank (in a thread
    for a background save): file I/O only, no collective. `commit` runs on every rank's
    main thread: it waits for the files, agrees on failures and commits."""

    mesh: ParallelMesh
    cfg: Config
    tmp: Path
    root: Path
    step: int
    progress: dict
    keep: int | None
    thread: threading.Thread | None = None
    error: OSError | None = None

    def write(self, snap: list[tuple[dict, torch.Tensor]], rng: dict) -> None:
        try:
            _write_files(self.tmp, self.mesh, snap, rng)
        except OSError as e:  # a full disk, a vanished directory: reported at commit
            self.error = e

    def commit(self) -> Path:
        if self.thread is not None:
            self.thread.join()
        with _outside_step(self.mesh):
            _check_writes(self.mesh, self.tmp, self.step, self.error)
            return _commit_all(self.mesh, self.cfg, self.tmp, self.root, self.step,
                               self.progress, self.keep)


def _check_writes(mesh: ParallelMesh, tmp: Path, step: int, err: OSError | None) -> None:
    failed = _agree(mesh, [int(r == mesh.rank and err is not None)
                           for r in range(mesh.world_size)])
    if not any(failed):
        return
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    who = [r for r, f in enumerate(failed) if f]
    mine = f": {err.strerror or err} ({err.filename or tmp})" if err is not None else ""
    raise CheckpointError(f"checkpoint step {step}: rank(s) {who} failed to write{mine}; "
                          "nothing was committed, the previous checkpoints are kept")


def _write_files(tmp: Path, mesh: ParallelMesh, snap: list[tuple[dict, torch.Tensor]],
                 rng: dict) -> None:
    """This rank's data file and its manifest."""
    name = rank_file(mesh.rank)
    writer = RankWriter(tmp / name)
    chunks = []
    try:
        for meta, host in snap:
            chunks.append({**meta, "file": name, "offset": writer.write(host.numpy())})
    finally:
        entry = writer.close()
    write_json(tmp / name.replace(".bin", ".json"),
               {"rank": mesh.rank, "coords": mesh.coords, "file": name, **entry,
                "chunks": chunks, "rng": rng})


def _commit_all(mesh: ParallelMesh, cfg: Config, tmp: Path, root: Path, step: int,
                progress: dict, keep: int | None) -> Path:
    err, final = "", step_dir(root, step)
    if mesh.rank == 0:
        try:
            _commit(mesh, cfg, tmp, final, step, progress)
        except (OSError, CheckpointError) as e:
            err = str(e)
            shutil.rmtree(tmp, ignore_errors=True)
    if _agree(mesh, [int(bool(err))])[0]:
        raise CheckpointError(f"checkpoint step {step}: commit failed"
                              f"{': ' + err if err else ' on rank 0'}; the previous "
                              "checkpoints are kept")
    if mesh.rank == 0 and keep:
        prune(root, keep)
    return final


def _own_states(cfg: Config, name: str, p: torch.Tensor) -> dict:
    """Muon: each tensor's own states (a matrix its momentum, the rest AdamW's moments);
    other optimizers: the optimizer's list, said once."""
    return {"states": list(muon_states(name, p))} if cfg.train.optimizer == "muon" else {}


def _commit(mesh: ParallelMesh, cfg: Config, tmp: Path, final: Path, step: int,
            progress: dict) -> None:
    files, chunks, rng = {}, [], {}
    for r in range(mesh.world_size):
        m = json.loads((tmp / rank_file(r).replace(".bin", ".json")).read_text())
        files[m["file"]] = {"rank": r, "coords": m["coords"], "bytes": m["bytes"],
                            "block_crc32": m["block_crc32"]}
        chunks += m["chunks"]
        rng[str(r)] = m["rng"]
    model = build_model(cfg.model, seed=0, device="meta")  # names and global shapes
    dtype = str(saved_dtype(cfg)).removeprefix("torch.")
    meta = {
        "format": FORMAT, "plait_version": plait_version(), "torch_version": torch.__version__,
        "step": step, "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "layout": {"world_size": mesh.world_size, "sizes": mesh.sizes,
                   "order": list(mesh.order), "describe": mesh.describe(),
                   "zero": cfg.parallel.zero, "schedule": cfg.parallel.schedule,
                   "sp": cfg.parallel.sp, "precision": cfg.train.precision},
        "config": cfg.to_dict(), "progress": {"next_step": step, **progress},
        "optimizer": {"kind": cfg.train.optimizer, "steps": progress["optimizer_steps"],
                      "states": list(states_of(cfg.train.optimizer))},
        "tensors": {**{n: {"shape": list(p.shape), "dtype": dtype, **_own_states(cfg, n, p)}
                       for n, p in model.named_parameters()},
                    # training state beside the parameters (MoE balancing biases)
                    **{f"{n}.bias": {"shape": [m.bias.numel()], "dtype": dtype,
                                     "kind": "buffer", "states": ["master"]}
                       for n, m in moe_layers([model])}},
        "rng": rng, "block_bytes": BLOCK, "files": files, "chunks": chunks,
    }
    check_coverage(meta)
    raw = write_json(tmp / METADATA, meta)
    write_json(tmp / MARKER, {"step": step, "metadata_crc32": zlib.crc32(raw)})
    fsync_dir(tmp)
    old = None
    if final.exists():  # the same step saved before (a resumed run): replace it whole
        old = final.with_name(f"{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
        final.rename(old)
    tmp.rename(final)  # the commit
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep: int) -> list[Path]:
    """After a commit: delete all but the newest `keep` committed checkpoints, and what
    dead attempts left (uncommitted `step-N`, `*.tmp-*`, `*.old-*`). Returns the deleted."""
    gone = []
    committed = [p for _, p, ok in checkpoints(root) if ok]
    gone += committed[keep:]
    gone += [p for _, p, ok in checkpoints(root) if not ok]
    gone += [p for p in Path(root).iterdir() if p.is_dir() and p.name.startswith("step-")
             and (".tmp-" in p.name or ".old-" in p.name)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
