"""Checkpoints are atomic and verified (docs/checkpoint.md): a truncated
or corrupted shard is found and the resume falls back (or, named explicitly, fails naming
the file); --keep deletes only after the new commit; a full disk and an unwritable
directory are clear errors that leave the previous checkpoints; bad resume input is
refused before any collective; the commit refuses chunks that overlap or leave gaps."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import config
from test_checkpoint import DP2_Z2, LAYERS, _copy, _full, _losses, _run

from plait.checkpoint.format import CheckpointError
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model


# ---- item 5: atomic and verified --------------------------------------------------------
def _corrupt(path: Path, truncate: bool) -> None:
    data = bytearray(path.read_bytes())
    if truncate:
        path.write_bytes(bytes(data[:len(data) // 2]))
    else:
        data[len(data) // 3] ^= 0xFF  # one byte flipped, the size unchanged
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("truncate", [True, False], ids=["truncated", "corrupted"])
def test_bad_shard_falls_back_to_the_previous_checkpoint(tmp_path, truncate):
    full, src = _full(DP2_Z2)
    d = _copy(src, tmp_path)
    (d / "step-00000004" / "COMMITTED").unlink()  # uncommitted: never loaded
    shutil.copytree(src / "step-00000002", d / "step-00000003")  # a newer one to spoil
    meta = d / "step-00000003" / "metadata.json"
    meta.write_text(meta.read_text().replace('"step": 2', '"step": 3'))  # fix its marker
    import json
    import zlib
    (d / "step-00000003" / "COMMITTED").write_text(json.dumps(
        {"step": 3, "metadata_crc32": zlib.crc32(meta.read_bytes())}))
    bad = d / "step-00000003" / "rank-00001.bin"
    _corrupt(bad, truncate)
    # resumed as ZeRO-3: rank r reads only rank r's file, so only rank 1 sees a flipped
    # byte; the all-reduce makes rank 0 fall back with it
    res = _run(("parallel.dp=2", "parallel.zero=3"), {"dir": d, "resume": "latest"})
    for o in res:
        assert o["resumed_from"] == d / "step-00000002", o["warnings"]
        assert any("step-00000003" in w for w in o["warnings"]), o["warnings"]
    assert any(str(bad) in w and ("truncated" if truncate else "checksum") in w
               for w in res[1]["warnings"]), res[1]["warnings"]
    assert _losses(res)[0] == pytest.approx(_losses(full)[0][2:], rel=1e-6)
    # named explicitly, there is no fallback: an error naming the file, before training
    res = _run(("parallel.dp=2", "parallel.zero=3"), {"resume": str(d / "step-00000003")})
    assert any(o["error"] and str(bad) in o["error"] for o in res)
    assert all(o["error"] and not o["rows"] for o in res)


def test_keep_deletes_old_checkpoints_only_after_the_new_commit(tmp_path):
    from plait.checkpoint import writer

    d = tmp_path / "ck"
    (d / "step-00000001.tmp-99").mkdir(parents=True)  # a dead attempt's leftovers
    log = tmp_path / "seen.txt"  # the rank is a forked process: it reports through a file
    real = writer.prune

    def spy(root, keep):
        committed = [p.name for p in sorted(root.iterdir()) if (p / "COMMITTED").exists()]
        with open(log, "a") as f:
            f.write(" ".join(committed) + "\n")
        return real(root, keep)
    writer.prune = spy  # forked below: the rank inherits it
    try:
        _run((), {"dir": d, "every": 1, "keep": 2})
    finally:
        writer.prune = real
    # at each prune the new checkpoint was already committed beside the old ones
    seen = log.read_text().splitlines()
    assert seen == ["step-00000001", "step-00000001 step-00000002",
                    "step-00000001 step-00000002 step-00000003",
                    "step-00000002 step-00000003 step-00000004"], seen
    assert sorted(p.name for p in d.iterdir()) == ["step-00000003", "step-00000004"]


def test_full_disk_is_a_clear_error_and_the_previous_checkpoint_survives(tmp_path):
    d = tmp_path / "ck"
    res = _run(DP2_Z2, {"dir": d, "every": 2}, fail_write={"rank": 1, "step": 4})
    assert "No space left on device" in res[1]["error"]
    assert "rank(s) [1] failed to write" in res[0]["error"], res[0]["error"]
    assert all("previous checkpoints are kept" in o["error"] for o in res)
    assert [p.name for p in d.iterdir()] == ["step-00000002"]  # no temporary left
    assert (d / "step-00000002" / "COMMITTED").is_file()
    # every later save is refused the same way; step 2 is still a valid resume point
    res = _run(DP2_Z2, {"resume": str(d)})
    assert res[0]["resumed_from"] == d / "step-00000002" and res[0]["error"] is None


def test_unwritable_directory_and_bad_resume_fail_before_any_collective(tmp_path):
    from plait.checkpoint import restore
    from plait.parallel.parallelize import parallelize

    blocker = tmp_path / "file"
    blocker.write_text("")
    res = _run(DP2_Z2, {"dir": blocker / "sub", "every": 1})
    assert all("cannot create a directory" in o["error"] for o in res)
    # the first save, after step 0 (before its on_step), failed on every rank alike
    # (`plait train` refuses such a directory before launching: tests below)
    assert all(not o["rows"] for o in res)
    _, src = _full(DP2_Z2)
    cfg = config(LAYERS, "model.dim=32")
    par = parallelize(build_model(cfg.model, seed=0, device="meta"),
                      ParallelMesh.build(cfg.parallel), cfg)
    with pytest.raises(CheckpointError, match="another model .*dim: saved 64, now 32"):
        restore(par, ParallelMesh.build(cfg.parallel), cfg, src)
    with pytest.raises(CheckpointError, match="no such directory"):
        restore(par, ParallelMesh.build(cfg.parallel), cfg, tmp_path / "nope")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        restore(par, ParallelMesh.build(cfg.parallel), cfg, tmp_path)
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        restore(par, ParallelMesh.build(cfg.parallel), cfg, blocker)


def test_commit_refuses_chunks_that_overlap_or_leave_gaps():
    from plait.checkpoint.format import check_coverage

    def meta(*chunks):
        return {"tensors": {"w": {"shape": [4, 6]}}, "optimizer": {"states": ["master"]},
                "chunks": [{"name": "w", "state": "master", "box_offset": list(o),
                            "box_shape": list(b), "start": a, "stop": z}
                           for o, b, a, z in chunks]}
    check_coverage(meta(((0, 0), (4, 3), 0, 12), ((0, 3), (4, 3), 0, 12)))  # two columns
    check_coverage(meta(((0, 0), (4, 6), 0, 10), ((0, 0), (4, 6), 10, 24)))  # ZeRO ranges
    with pytest.raises(CheckpointError, match="24 elements .overlapping."):
        check_coverage(meta(((0, 0), (4, 3), 0, 12), ((0, 0), (4, 3), 0, 12)))  # same slice
    with pytest.raises(CheckpointError, match="w master: the chunks hold 12 elements"):
        check_coverage(meta(((0, 0), (4, 3), 0, 12)))
