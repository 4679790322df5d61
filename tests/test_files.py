"""plait/files.py: outputs checked before work, written whole or not at all."""

import os

import pytest

from plait.files import PartialFile, atomic_output, output_problems, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.png"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(target) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".png"  # writers choose by suffix
        tmp.write_text("half")
        raise RuntimeError("the writer failed")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png"]


def test_a_write_creates_parents_and_replaces_whole(tmp_path):
    target = tmp_path / "a" / "b" / "t.json"
    assert write_text_atomic(target, "new") == target
    assert target.read_text() == "new" and len(list(target.parent.iterdir())) == 1


def test_partial_file_is_renamed_only_when_finished(tmp_path):
    target = tmp_path / "m.jsonl"
    target.write_text("complete earlier run\n")
    run = PartialFile(target)
    run.write_line("step 0")
    assert target.read_text() == "complete earlier run\n"  # untouched while running
    kept = run.abandon()
    assert kept.name == "m.jsonl.partial" and kept.read_text() == "step 0\n"
    assert target.read_text() == "complete earlier run\n"
    done = PartialFile(target)
    done.write_line("step 0")
    assert done.finish() == target and target.read_text() == "step 0\n"
    assert not kept.exists()


def test_output_problems(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    assert output_problems("--out", tmp_path / "new" / "deep" / "x") == []
    assert "is a directory" in output_problems("--out", tmp_path / "d")[0]
    assert "is a file, not a directory" in output_problems("--out", tmp_path / "f" / "x")[0]
    assert "is also an input" in output_problems("--out", tmp_path / "f", [tmp_path / "f"])[0]
    os.link(tmp_path / "f", tmp_path / "hard")
    assert "is also an input" in output_problems("--out", tmp_path / "hard",
                                                 [tmp_path / "f"])[0]
    assert "is empty" in output_problems("--out", "")[0]
