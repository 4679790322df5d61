"""Background (async) checkpoints: the save returns after a host copy,
a thread writes the files while training goes on, the next step commits. The files are
the synchronous save's, byte for byte, and later updates cannot leak into them."""

from __future__ import annotations

import shutil
import threading

import torch
from helpers import config, session_dir
from test_checkpoint import DP2_Z2, LAYERS, _full, _run

from plait.checkpoint import PendingSave, save
from plait.checkpoint import format as fmt
from plait.checkpoint.format import read_metadata
from plait.checkpoint.reader import full_tensor
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.parallel.parallelize import parallelize

ROOT = session_dir("checkpoints-async")


def test_background_save_writes_the_synchronous_files_and_resumes_exactly():
    sync_outs, sync = _full(DP2_Z2)
    d = ROOT / "dp2z2"
    shutil.rmtree(d, ignore_errors=True)
    outs = _run(DP2_Z2, {"dir": d, "every": 2, "background": True})
    assert [r["loss"] for r in outs[0]["rows"]] == [r["loss"] for r in sync_outs[0]["rows"]]
    for step in ("step-00000002", "step-00000004"):  # the last one committed by finish()
        assert (d / step / "COMMITTED").is_file()
        for r in range(2):
            f = fmt.rank_file(r)
            assert (d / step / f).read_bytes() == (sync / step / f).read_bytes(), (step, f)
    res = _run(DP2_Z2, {"resume": str(d / "step-00000002"), "background": True})
    assert [r["loss"] for r in res[0]["rows"]] == [r["loss"] for r in sync_outs[0]["rows"][2:]]


def test_background_save_holds_the_state_of_its_step(tmp_path):
    """The writer thread is held until the live state has changed: the files must still
    hold the state at the save (the snapshot is a copy, not a view)."""
    cfg = config(LAYERS)
    mesh = ParallelMesh.build(cfg.parallel)
    par = parallelize(build_model(cfg.model, seed=cfg.train.seed, device="meta"), mesh, cfg)
    before = {n: p.detach().clone() for n, p in par.model.named_parameters()}
    go, real = threading.Event(), fmt.RankWriter.write

    def held(self, data):
        go.wait(timeout=30)
        return real(self, data)
    fmt.RankWriter.write = held
    try:
        pending = save(par, mesh, cfg, tmp_path, 1, background=True)
        assert isinstance(pending, PendingSave) and pending.thread.is_alive()
        with torch.no_grad():  # what the next update would do, while the thread waits
            for p in par.model.parameters():
                p.add_(1.0)
        go.set()
        path = pending.commit()
    finally:
        fmt.RankWriter.write = real
    meta = read_metadata(path)
    for n, t in before.items():
        assert torch.equal(torch.from_numpy(full_tensor(path, meta, n)), t), n
