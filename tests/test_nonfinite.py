"""A non-finite gradient norm skips the step's update on every rank; K in a row stop the run
with a clear error, and the checkpoints keep the weights from before.
The NaN is injected into one rank's gradients only: the global norm
must carry it to every rank, or the ranks would disagree and the replicas diverge."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from helpers import batches_for, config, session_dir, token_file

from plait.checkpoint import Checkpointing
from plait.checkpoint.format import read_metadata
from plait.checkpoint.reader import full_tensor
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.train import loop

SETS = ("parallel.dp=2", "parallel.zero=1")
ROOT = session_dir("nonfinite")


def _rank(rank: int, world: int, nan_steps: tuple[int, ...], ck: dict, limit: int,
          update_whatever_the_norm: bool = False) -> dict:
    cfg = config(*SETS, f"train.max_nonfinite_steps={limit}").check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    real = loop.parallelize

    def poisoned(model, mesh_, cfg_, **kwargs):
        par = real(model, mesh_, cfg_, **kwargs)
        if rank == 1:  # one rank's gradient of one tensor, at the chosen steps
            p = next(iter(par.model.parameters()))
            p.register_hook(lambda g: g * float("nan") if mesh.ledger.step in nan_steps
                            else g)
        return par
    loop.parallelize = poisoned
    checkpoint = Checkpointing(**ck)
    rows: list[dict] = []
    try:
        result = loop.train(cfg, mesh, batches_for(cfg),
                            loop.TrainOptions(on_step=rows.append, checkpoint=checkpoint,
                                              update_whatever_the_norm=update_whatever_the_norm))
    except loop.NonFiniteError as e:
        return {"rows": rows, "error": str(e)}
    params = loop.full_state(result.model, result.optimizer, mesh, result.placements)
    return {"rows": rows, "error": None, "params": params}


def _states(path: Path) -> dict:
    meta = read_metadata(path)
    return {(n, s): full_tensor(path, meta, n, s) for n in meta["tensors"]
            for s in meta["optimizer"]["states"]}, meta["optimizer"]["steps"]


def _same(a: Path, b: Path) -> bool:
    (sa, _), (sb, _) = _states(a), _states(b)
    return sa.keys() == sb.keys() and all((sa[k] == sb[k]).all() for k in sa)


def test_one_nonfinite_step_is_skipped_everywhere_and_resume_counts_updates():
    token_file()
    d = ROOT / "one"
    shutil.rmtree(d, ignore_errors=True)
    outs = run_ranks(_rank, 2, (1,), {"dir": d, "every": 1}, 2)
    for o in outs:
        assert [bool(r.get("skipped")) for r in o["rows"]] == [False, True, False, False]
        assert o["error"] is None and all(torch.isfinite(t).all() for t in o["params"].values())
    # the skipped step changed no weight and no moment, and made no update
    assert _same(d / "step-00000001", d / "step-00000002")
    assert [_states(d / f"step-{s:08d}")[1] for s in (1, 2, 3)] == [1, 1, 2]
    assert not _same(d / "step-00000002", d / "step-00000003")
    # resumed after the skip: the same losses (Adam's bias correction uses 2 updates at
    # step 3, not 3: a wrong count would change them)
    res = run_ranks(_rank, 2, (), {"resume": str(d / "step-00000002")}, 2)
    assert [r["loss"] for r in res[0]["rows"]] == [r["loss"] for r in outs[0]["rows"][2:]]
    assert all(torch.equal(res[0]["params"][n], t) for n, t in outs[0]["params"].items())


def test_k_nonfinite_steps_in_a_row_stop_the_run_and_keep_the_last_good_weights():
    token_file()
    d = ROOT / "streak"
    shutil.rmtree(d, ignore_errors=True)
    outs = run_ranks(_rank, 2, (1, 2), {"dir": d, "every": 1}, 2)
    for o in outs:
        assert len(o["rows"]) == 3 and o["rows"][1]["skipped"] and o["rows"][2]["skipped"]
        assert "steps 1..2: 2 non-finite gradient norms in a row" in o["error"], o["error"]
        assert str(d / "step-00000003") in o["error"] and "Lower the learning rate" in o["error"]
    # every checkpoint written during the streak holds the weights from before it
    assert _same(d / "step-00000001", d / "step-00000003")


def test_a_dry_runs_steps_update_whatever_the_norm():
    """A dry run (fake process group: values are whatever the buffers held) runs every
    step's update, so each step issues all of its collectives (Muon's exchange, ZeRO's
    gathers): a non-finite norm skips nothing there, and the weights take it."""
    token_file()
    d = ROOT / "dry"
    shutil.rmtree(d, ignore_errors=True)
    outs = run_ranks(_rank, 2, (1,), {"dir": d, "every": 100}, 2, True)
    for o in outs:
        assert [bool(r.get("skipped")) for r in o["rows"]] == [False] * 4
        assert not all(torch.isfinite(t).all() for t in o["params"].values())
