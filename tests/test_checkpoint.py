"""Checkpoints (plait/checkpoint, docs/checkpoint.md): exact resume on the same layout,
resharding to other layouts and world sizes, inspect/consolidate, the train flags through
torchrun. Atomicity and verification: tests/test_checkpoint_atomic.py; background saves:
tests/test_checkpoint_async.py.

Every training run here is the tiny MHA model with 4 layers, 4 steps (checkpoints after
step 2), on forked gloo ranks; the uninterrupted runs are shared by the tests (and those
files) through `_full` (one per layout), so each layout trains once.
"""

from __future__ import annotations

import errno
import shutil
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import batches_for, config, reference, session_dir, token_file

from plait.checkpoint import Checkpointing, CheckpointWarning
from plait.checkpoint.format import CheckpointError, global_runs, intersect
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.testing import assert_parity
from plait.train.loop import TrainOptions, full_state, train

LAYERS = "model.n_layers=4"  # pp=2 with two chunks a rank (zb-v, dualpipe) needs 4 stages
ROOT = session_dir("checkpoints")

DP4_Z1 = ("parallel.dp=4", "parallel.zero=1")
DP2_Z2 = ("parallel.dp=2", "parallel.zero=2")
PP2_TP2_SP = ("parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.schedule=1f1b",
              "parallel.microbatches=4")
DUALPIPE = ("parallel.pp=2", "parallel.schedule=dualpipe", "parallel.microbatches=4")
# post-validation (plait/parallel/post_validation.py): the saving run checks each step
# before the next (a checkpoint holds settled weights), the resumed one overlaps them
ZBH2_POST = ("parallel.pp=2", "parallel.schedule=zb-h2", "parallel.microbatches=4",
             "parallel.optimizer_sync=post_validation")
TP2 = ("parallel.tp=2",)
BF16_DP2_Z1 = ("train.precision=bf16", "parallel.dp=2", "parallel.zero=1")
SGD = ("train.optimizer=sgd", "train.weight_decay=0")  # plain SGD: masters only, no moments
# MoE with a fast-moving balancing bias: a bias lost on resume changes routing at once
MOE = ("model.n_experts=8", "model.top_k=2", "model.expert_ffn_dim=32",
       "model.n_shared_experts=1", "model.aux_loss_coef=0.01", "model.bias_update_rate=0.01")
EP2_Z1 = (*MOE, "parallel.dp=2", "parallel.ep=2", "parallel.zero=1")
# hybrid sharding: ZeRO inside 2-rank shard groups, copies in the other group (one writes)
HYBRID_Z3 = ("parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.zero=3")


# the first model built on meta imports torch's reference ops (~10 s a process on a busy
# machine): once here, so the forked ranks inherit them instead of each paying
build_model(config(LAYERS).model, seed=0, device="meta")


class _Stop(Exception):
    """Raised from on_step: the run stops there, as if killed after that step."""


def _rank(rank: int, world: int, sets: list[str], ck: dict, stop_after: int | None = None,
          fail_write: dict | None = None) -> dict:
    cfg = config(LAYERS, *sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    if fail_write is not None and rank == fail_write["rank"]:  # a full disk, on this rank
        from plait.checkpoint import format as fmt
        real = fmt.RankWriter.write

        def write(self, data):
            if f"step-{fail_write['step']:08d}" in str(self.path):
                raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
            return real(self, data)
        fmt.RankWriter.write = write
    checkpoint = Checkpointing(**ck)
    rows: list[dict] = []

    def on_step(row: dict) -> None:
        rows.append(row)
        if stop_after is not None and row["step"] == stop_after:
            raise _Stop

    out = {"rows": rows, "error": None, "warnings": []}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", CheckpointWarning)
        try:
            result = train(cfg, mesh, batches_for(cfg),
                           TrainOptions(on_step=on_step, checkpoint=checkpoint))
            out["params"] = full_state(result.model, result.optimizer, mesh,
                                       result.placements)
        except _Stop:
            pass
        except CheckpointError as e:
            out["error"] = str(e)
    out["warnings"] = [str(w.message) for w in seen if issubclass(w.category,
                                                                   CheckpointWarning)]
    out["resumed_from"] = checkpoint.resumed_from
    out["ledger"] = [r for r in mesh.ledger.to_dicts() if r["tag"] == "checkpoint"]
    return out


def _world(sets) -> int:
    return config(LAYERS, *sets).parallel.world_size


def _run(sets, ck: dict, **kw) -> list[dict]:
    token_file()
    return run_ranks(_rank, _world(sets), list(sets), ck, **kw)


def _params(outs: list[dict]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for o in outs:
        assert o["error"] is None, o["error"]
        for n, t in o["params"].items():
            assert n not in merged or torch.equal(merged[n], t), n
            merged[n] = t
    return merged


def _losses(outs):
    return [r["loss"] for r in outs[0]["rows"]], [r["grad_norm"] for r in outs[0]["rows"]]


@cache
def _full(sets: tuple[str, ...]) -> tuple[list[dict], Path]:
    """The uninterrupted 4-step run of a layout, saving after steps 2 and 4."""
    d = ROOT / "full" / "_".join(s.split(".")[-1] for s in sets or ("single",))
    shutil.rmtree(d, ignore_errors=True)
    outs = _run(sets, {"dir": d, "every": 2})
    assert all(o["error"] is None for o in outs), [o["error"] for o in outs]
    return outs, d


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


# ---- geometry ---------------------------------------------------------------------------
def test_runs_of_boxes_and_ranges_cover_the_right_elements():
    shape = (6, 10)
    full = np.arange(60).reshape(shape)
    for off, box, a, b in [((0, 0), (6, 10), 7, 43), ((2, 0), (3, 10), 5, 30),
                           ((0, 4), (6, 3), 0, 18), ((0, 4), (6, 3), 4, 13),
                           ((1, 5), (4, 5), 3, 17)]:
        g, loc, n = global_runs(shape, off, box, a, b)
        want = full[off[0]:off[0] + box[0], off[1]:off[1] + box[1]].reshape(-1)[a:b]
        got = np.concatenate([np.arange(s, s + k) for s, k in zip(g, n, strict=True)])
        assert (got == want).all(), (off, box, a, b)
        assert loc[0] == a and loc[-1] + n[-1] == b
    # a column slice against a row range: the overlap is elements of both
    need = global_runs(shape, (0, 4), (6, 3), 0, 18)
    have = global_runs(shape, (0, 0), (6, 10), 20, 40)
    pairs = intersect(need, have)
    assert sum(n for _, _, n in pairs) == 6  # rows 2 and 3, columns 4..6
    assert all(full.reshape(-1)[hb + k] == full[:, 4:7].reshape(-1)[na + k]
               for na, hb, n in pairs for k in range(n))  # box-local indices


# ---- item 2: exact resume on the same layout ---------------------------------------------
@pytest.mark.parametrize("sets", [(), DP2_Z2, ("parallel.dp=2", "parallel.zero=3"),
                                  PP2_TP2_SP, DUALPIPE, BF16_DP2_Z1, EP2_Z1, ZBH2_POST,
                                  HYBRID_Z3],
                         ids=lambda s: "+".join(s) or "single")
def test_resume_same_layout_is_bit_identical(sets):
    # bf16 too: the compute parameter is its master cast, after an update and after a load
    full, d = _full(sets)
    res = _run(sets, {"resume": str(d / "step-00000002")})
    assert [r["step"] for r in res[0]["rows"]] == [2, 3]
    # fp32, the same layout: the same operations on the same bits in the same order
    assert _losses(res)[0] == _losses(full)[0][2:]
    assert _losses(res)[1] == _losses(full)[1][2:]
    a, b = _params(full), _params(res)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_killed_run_resumes_from_latest_complete(tmp_path):
    d = tmp_path / "ck"  # stopped after step index 2: step 2 committed, step 3 lost
    first = _run(DP2_Z2, {"dir": d, "every": 2}, stop_after=2)
    assert len(first[0]["rows"]) == 3 and (d / "step-00000002" / "COMMITTED").is_file()
    res = _run(DP2_Z2, {"dir": d, "every": 2, "resume": "latest"})
    full, _ = _full(DP2_Z2)
    assert res[0]["resumed_from"] == d / "step-00000002"
    assert _losses(res)[0] == _losses(full)[0][2:]
    assert all(torch.equal(_params(res)[n], t) for n, t in _params(full).items())
    # the checkpoint's collectives are ledgered under their tag, outside the steps
    assert res[0]["ledger"] and all(r["step"] == -1 for r in res[0]["ledger"])


# ---- item 3: reshard ---------------------------------------------------------------------
PAIRS = [  # the parity matrix has 11 more round trips between its rows (tests/test_matrix.py)
    (DP4_Z1, ("parallel.dp=2",)),  # 4 -> 2 ranks, ZeRO-1 -> replicated
    (DUALPIPE, ("parallel.dp=4", "parallel.zero=3")),  # 2 -> 4
    (TP2, ()),  # 2 -> 1
    ((*SGD, *DP2_Z2), (*SGD, *TP2)),  # SGD: no moments saved or needed
    (EP2_Z1, (*MOE, "parallel.dp=2", "parallel.tp=2")),  # experts over ep -> replicated
    ((*MOE, "parallel.tp=2"), (*MOE, "parallel.dp=4", "parallel.ep=4", "parallel.zero=3")),
    (HYBRID_Z3, DP2_Z2),  # 2 x 2 hybrid -> plain dp on 2 ranks
    (DP4_Z1, ("parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.zero=2")),  # 4x1 -> 2x2
]


@pytest.mark.parametrize("src, dst", PAIRS, ids=[f"{'+'.join(a)}->{'+'.join(b) or 'single'}"
                                                 for a, b in PAIRS])
def test_reshard_continues_within_parity_of_the_reference(src, dst):
    full, d = _full(src)
    res = _run(dst, {"resume": str(d / "step-00000002")})
    # the stitched run: the source's first two steps, the new layout's last two
    losses, norms = _losses(full)
    new_losses, new_norms = _losses(res)
    run = {"losses": losses[:2] + new_losses, "grad_norms": norms[:2] + new_norms,
           "params": _params(res)}
    ref = reference(LAYERS, *(s for s in src if not s.startswith("parallel.")))
    # both layouts only reorder float64 sums, and the checkpoint keeps float64 states
    assert_parity(run, ref, "fp64")


# ---- item 4: inspect and consolidate -----------------------------------------------------
def test_consolidate_writes_the_full_model_as_safetensors(tmp_path, capsys):
    from plait.checkpoint.export import read_safetensors
    from plait.cli.main import main

    full, d = _full(PP2_TP2_SP)  # tp slices over two pipeline stages: four files
    want = _params(full)  # the final parameters, tp gathered, both stages
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "consolidate", str(d), "--out", str(out)]) == 0
    got = read_safetensors(out)  # the newest checkpoint: the last step's
    # the float64 run's states, written as fp32 (consolidate's default --dtype)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n].float()) for n in want)
    assert main(["checkpoint", "consolidate", str(d / "step-00000002"), "--out", str(out),
                 "--dtype", "bf16", "--force"]) == 0  # replacing the fp32 file
    half = read_safetensors(out)
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert half["layers.0.attn.wq.weight"].shape == want["layers.0.attn.wq.weight"].shape
    assert not torch.equal(half["head.weight"].float(), want["head.weight"].bfloat16().float())
    nested = tmp_path / "new" / "dir" / "m.safetensors"  # created, as every output is
    assert main(["checkpoint", "consolidate", str(d), "--out", str(nested)]) == 0
    assert set(read_safetensors(nested)) == set(want)
    assert main(["checkpoint", "consolidate", str(d), "--out", str(out / "x")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_inspect_shows_step_layout_tensors_bytes_and_completeness(tmp_path, capsys):
    from plait.cli.main import main

    full, src = _full(PP2_TP2_SP)
    d = _copy(src, tmp_path)
    (d / "step-00000004" / "COMMITTED").unlink()  # as if killed before the commit
    assert main(["checkpoint", "inspect", str(d)]) == 0
    text = capsys.readouterr().out
    assert "step        2" in text and "INCOMPLETE (no marker)" in text
    assert "complete, every checksum verified" in text
    assert "pp=2" in text and "tp=2" in text and "sp True" in text
    for r in range(4):
        assert f"rank {r:>4}" in text
    assert "layers.3.mlp.w2.weight" in text and "64x176" in text  # global shapes
    assert main(["checkpoint", "inspect", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    only = tmp_path / "only"  # nothing committed: the listing, and the error
    shutil.copytree(d / "step-00000004", only / "step-00000004")
    assert main(["checkpoint", "inspect", str(only)]) == 2
    err = capsys.readouterr().err
    assert "INCOMPLETE (no marker)" in err and "no committed checkpoint (1 uncommitted)" in err


# ---- the CLI: plait train --checkpoint-dir/--checkpoint-every/--resume ------------------
def _plait(*args):
    import subprocess
    import sys

    from helpers import BASE

    sets = [a for s in (*BASE, LAYERS) for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "plait.cli", *args[:1], "--data",
                           str(token_file()), *sets, *args[1:]], capture_output=True,
                          text=True, timeout=300)


def _metrics(path: Path) -> list[dict]:
    import json

    return [r for r in map(json.loads, path.read_text().splitlines()) if "step" in r]


def test_train_refuses_bad_checkpoint_input_before_any_rank_starts(tmp_path, capsys):
    from plait.cli.main import main

    _, src = _full(DP2_Z2)
    m = tmp_path / "m.jsonl"
    m.write_text("")  # a file where --checkpoint-dir would need a folder
    layout = ["--nproc", "2", "--dp", "2", "--zero", "2", "--quiet"]
    # bad input is refused before any rank starts (in this process: main returns first)
    from helpers import BASE
    sets = ["--data", str(token_file()), *[a for s in (*BASE, LAYERS) for a in ("--set", s)]]
    for extra, message in [
            (["--resume", str(src)], "nothing left to train"),
            (["--resume", str(src), "--steps", "6", "--set", "model.dim=32"], "another model"),
            (["--resume"], "--resume without a path"),
            (["--resume", str(tmp_path / "nope")], "no such directory"),
            (["--checkpoint-every", "2"], "need --checkpoint-dir"),
            (["--checkpoint-dir", str(m / "x"), "--checkpoint-every", "1"], "cannot create")]:
        assert main(["train", *sets, *layout, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def _spoil_a_newer_copy(d: Path, step: int, newer: int) -> Path:
    """A committed step-`newer` copy of step-`step` with one byte of a shard flipped."""
    import json
    import zlib

    src, dst = d / f"step-{step:08d}", d / f"step-{newer:08d}"
    shutil.copytree(src, dst)
    meta = dst / "metadata.json"
    meta.write_text(meta.read_text().replace(f'"step": {step}', f'"step": {newer}'))
    (dst / "COMMITTED").write_text(json.dumps(
        {"step": newer, "metadata_crc32": zlib.crc32(meta.read_bytes())}))
    data = bytearray((dst / "rank-00000.bin").read_bytes())
    data[len(data) // 3] ^= 0xFF
    (dst / "rank-00000.bin").write_bytes(bytes(data))
    return dst


@pytest.mark.slow  # restarts of a launched process tree
def test_resume_in_one_launch_script_keeps_every_metrics_row_and_says_what_it_did(tmp_path,
                                                                                  capsys):
    """The same command for the first start and a restart: --resume on a missing
    --checkpoint-dir starts fresh; without --checkpoint-every the final state is saved;
    each resume and save is one line; a corrupt newer checkpoint is one plait warning; the
    metrics of the stopped run (NAME.partial, its last line cut by kill -9) keep their
    rows before the resume step and lose the rest to the new run's."""
    import json

    from plait.cli.main import main

    d, m = tmp_path / "ck", tmp_path / "m.jsonl"
    same = ["--nproc", "2", "--dp", "2", "--zero", "2", "--checkpoint-dir", str(d),
            "--resume", "--metrics-out", str(m)]
    first = _plait("train", *same)
    assert first.returncode == 0, first.stderr
    assert f"--resume: no checkpoint in {d} yet; starting from step 0" in first.stderr
    assert "only the final state (after step 4) is saved" in first.stderr
    assert f"checkpoint saved: {d / 'step-00000004'}" in first.stdout
    rows = _metrics(m)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # through torchrun, the same losses and checkpoint bytes as the layout's run in forks
    full, src = _full(DP2_Z2)
    assert [r["loss"] for r in rows] == [r["loss"] for r in full[0]["rows"]]
    for rk in range(2):
        f = f"step-00000004/rank-{rk:05d}.bin"
        assert (d / f).read_bytes() == (src / f).read_bytes(), f
    # as if stopped after step 5 and then killed: the rows NAME.partial keeps
    fake = [{**rows[-1], "step": s, "loss": 99.0} for s in (4, 5)]
    m.with_name(m.name + ".partial").write_text(
        "".join(json.dumps(r) + "\n" for r in rows + fake) + '{"step": 6, "lo')
    m.unlink()
    bad = _spoil_a_newer_copy(d, 4, 5)
    again = _plait("train", *same, "--set", "train.steps=6")
    assert again.returncode == 0, again.stderr
    assert f"resumed from {d / 'step-00000004'} at step 4" in again.stdout
    assert f"checkpoint saved: {d / 'step-00000006'}" in again.stdout
    skipped = [x for x in again.stderr.splitlines() if "skipping" in x]
    assert len(skipped) == 1 and skipped[0].startswith("plait: warning: skipping "), \
        again.stderr
    assert "CheckpointWarning" not in again.stderr and "warnings.warn" not in again.stderr
    merged = _metrics(m)
    assert [r["step"] for r in merged] == [0, 1, 2, 3, 4, 5]
    assert merged[:4] == rows and all(r["loss"] != 99.0 for r in merged[4:])
    assert not m.with_name(m.name + ".partial").exists()
    assert main(["checkpoint", "inspect", str(bad)]) == 1  # a script sees it is bad
    assert "CORRUPT" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(d / "step-00000006")]) == 0


def test_a_checkpoint_from_before_new_model_fields_still_resumes():
    """Fields added to ModelConfig later (MoE routing, RoPE scaling) hold their defaults in
    an older checkpoint: accepted; a real difference is still refused."""
    import dataclasses

    from plait.checkpoint.reader import check_compatible

    cfg = config("train.steps=10")
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items()
             if k not in ("n_dense_layers", "router_score", "capacity_factor")}
    meta = {"config": {"model": model, "train": dataclasses.asdict(cfg.train)},
            "optimizer": {"kind": cfg.train.optimizer}, "step": 2}
    check_compatible(meta, cfg, Path("old"))
    meta["config"]["model"]["dim"] = cfg.model.dim // 2
    with pytest.raises(CheckpointError, match="another model"):
        check_compatible(meta, cfg, Path("old"))


def test_states_are_saved_in_the_masters_dtype():
    """float64 where the model is float64 (the oracle's runs, fp8 around float64), so their
    resume continues exactly; fp32 masters and moments everywhere else."""
    from plait.checkpoint.writer import saved_dtype

    assert saved_dtype(config("train.precision=fp64")) == torch.float64
    assert saved_dtype(config("train.precision=fp8", "train.fp8_compute=fp64")) == torch.float64
    for sets in (("train.precision=fp32",), ("train.precision=bf16",),
                 ("train.precision=fp8",)):
        assert saved_dtype(config(*sets)) == torch.float32, sets
