"""One rule for every command that writes an artifact (a model, a token file, a config, a
profile, a plot, a page): an existing output is refused unless --force, and no output of
any command lies inside one of its inputs (through symlinks and `..`). A refusal comes
before any work, exits 2 naming the fix, and leaves the existing file byte for byte; with
--force the file is still replaced whole. Written files get the usual mode (0666 less the
umask). Metrics and traces keep their rule: a rerun writes them again.

One small checkpoint (one rank, four steps) serves the module; it is never written to.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
from pathlib import Path

import pytest
from helpers import batches_for, config, token_file

from plait import files
from plait.cli.main import main

STEP = "step-00000004"


def _save_checkpoint(rank: int, world: int, root: str) -> int:
    from plait.checkpoint import Checkpointing
    from plait.mesh import ParallelMesh
    from plait.train.loop import TrainOptions, train

    cfg = config("train.steps=4").check(world)
    train(cfg, ParallelMesh.build(cfg.parallel), batches_for(cfg),
          TrainOptions(checkpoint=Checkpointing(dir=Path(root), every=4, final=True)))
    return rank


@pytest.fixture(scope="module")
def ckq(tmp_path_factory) -> Path:
    from plait.launch.forked import run_ranks

    root = tmp_path_factory.mktemp("rules") / "ckq"
    token_file()  # made in the parent, before the rank forks
    run_ranks(_save_checkpoint, 1, str(root))
    return root


def _digest(root: Path) -> dict[str, str]:
    """Every file under `root` (or `root` itself) by its bytes' hash."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _usual_mode() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _refused(argv: list[str], capsys, *phrases: str) -> str:
    """`plait ARGV` exits 2 with every phrase in its message; the message."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    for phrase in phrases:
        assert phrase in err, err
    return err


# ---- checkpoint consolidate ------------------------------------------------------------
@pytest.mark.parametrize("inside", [f"{STEP}/metadata.json", f"{STEP}/rank-00000.bin"])
def test_consolidate_never_writes_into_the_checkpoint_it_reads(ckq, capsys, inside):
    before = _digest(ckq)
    _refused(["checkpoint", "consolidate", str(ckq), "--out", str(ckq / inside)], capsys,
             "inside", "choose a path outside it")
    assert _digest(ckq) == before
    assert main(["checkpoint", "inspect", str(ckq)]) == 0  # still sound
    # --force replaces an output, never an input
    _refused(["checkpoint", "consolidate", str(ckq), "--out", str(ckq / inside), "--force"],
             capsys, "inside")
    assert _digest(ckq) == before


def test_consolidate_inside_its_input_through_a_symlink_or_dotdot(ckq, tmp_path, capsys):
    before = _digest(ckq)
    link = tmp_path / "link"
    link.symlink_to(ckq, target_is_directory=True)
    _refused(["checkpoint", "consolidate", str(ckq), "--out",
              str(link / STEP / "metadata.json")], capsys, "inside")
    (tmp_path / "other").mkdir()
    dotdot = tmp_path / "other" / ".." / "link" / STEP / "new.safetensors"
    _refused(["checkpoint", "consolidate", str(ckq), "--out", str(dotdot)], capsys, "inside")
    assert _digest(ckq) == before and not (ckq / STEP / "new.safetensors").exists()


def test_consolidate_replaces_an_existing_file_only_with_force(ckq, tmp_path, capsys):
    from plait.checkpoint.export import read_safetensors

    out = tmp_path / "model.safetensors"
    out.write_bytes(b"an earlier export\n")
    _refused(["checkpoint", "consolidate", str(ckq), "--out", str(out)], capsys,
             "exists", "--force")
    assert out.read_bytes() == b"an earlier export\n"
    assert main(["checkpoint", "consolidate", str(ckq), "--out", str(out), "--force"]) == 0
    assert "head.weight" in read_safetensors(out) and _mode(out) == _usual_mode()
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temp left


def test_a_forced_write_that_fails_leaves_the_old_file_whole(ckq, tmp_path, monkeypatch):
    """--force replaces through a temporary file: a crash mid-write keeps the old one."""
    from plait.checkpoint import export as export_module

    out = tmp_path / "model.safetensors"
    out.write_bytes(b"the model that works\n")
    calls = []

    def dies_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    real = export_module.full_tensor
    monkeypatch.setattr(export_module, "full_tensor", dies_on_the_second)
    with pytest.raises(OSError, match="No space left"):
        export_module.consolidate(ckq, out)
    assert out.read_bytes() == b"the model that works\n"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


# ---- export ----------------------------------------------------------------------------
def test_export_files_get_the_usual_mode(ckq, tmp_path):
    assert main(["export", "--from", str(ckq), "--to", f"hf:{tmp_path / 'hf'}"]) == 0
    assert main(["export", "--from", str(ckq), "--to", f"dcp:{tmp_path / 'dcp'}"]) == 0
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in written)
    assert {p.name: _mode(p) for p in written} == {p.name: _usual_mode() for p in written}


def test_export_replaces_a_model_only_with_force(ckq, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine\n")
    _refused(["export", "--from", str(ckq), "--to", f"hf:{out}"], capsys,
             "not an empty directory", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["export", "--from", str(ckq), "--to", f"hf:{out}", "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # neither the old nor a temp left


def test_export_never_writes_into_or_over_its_source(ckq, tmp_path, capsys):
    before = _digest(ckq)
    _refused(["export", "--from", str(ckq), "--to", f"hf:{ckq / STEP / 'hf'}"], capsys,
             "inside --from")
    _refused(["export", "--from", str(ckq), "--to", f"dcp:{ckq}", "--force"], capsys,
             "inside --from")
    _refused(["export", "--from", str(ckq / STEP), "--to", f"hf:{ckq}", "--force"], capsys,
             "holds --from")
    assert _digest(ckq) == before


# ---- data prepare ----------------------------------------------------------------------
def test_data_prepare_replaces_a_token_file_only_with_force(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    out = tmp_path / "tok.bin"
    assert main(["data", "prepare", str(doc), "--out", str(out), "--vocab-size", "300"]) == 0
    before = {**_digest(out), **_digest(out.with_suffix(".json"))}
    _refused(["data", "prepare", str(doc), "--out", str(out), "--vocab-size", "300"], capsys,
             "tok.bin exists", "--force")
    assert {**_digest(out), **_digest(out.with_suffix(".json"))} == before
    doc.write_text("another text, so another token file\n" * 50)
    assert main(["data", "prepare", str(doc), "--out", str(out), "--vocab-size", "300",
                 "--force"]) == 0
    assert _digest(out) != {k: v for k, v in before.items() if k == str(out)}
    assert _mode(out) == _usual_mode()


def test_data_prepare_never_writes_into_its_inputs(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}\n")
    before = _digest(model)
    _refused(["data", "prepare", str(tmp_path / "doc.txt"), "--tokenizer", f"hf:{model}",
              "--out", str(model / "tokens.bin"), "--force"], capsys, "inside")
    notes = tmp_path / "notes.json"  # a text input where the token file's metadata would go
    notes.write_text("plain words, kept\n")
    _refused(["data", "prepare", str(notes), "--out", str(tmp_path / "notes.bin"),
              "--force"], capsys, "is also an input")
    assert _digest(model) == before and notes.read_text() == "plain words, kept\n"


# ---- plan, simulate, calibrate, report ---------------------------------------------------
PLAN = ["plan", "--model", "tiny", "--vocab", "256", "--seq", "32", "--global-batch", "8",
        "--gpus", "2", "--layout", "dp=2"]


@pytest.mark.parametrize("existing", ["run.toml", "run.plan.json"])
def test_plan_emit_config_and_its_plan_replaced_only_with_force(tmp_path, capsys, existing):
    (tmp_path / existing).write_text("earlier\n")
    toml = str(tmp_path / "run.toml")
    _refused([*PLAN, "--emit-config", toml], capsys, f"{existing} exists", "--force")
    assert [p.name for p in tmp_path.iterdir()] == [existing]
    assert (tmp_path / existing).read_text() == "earlier\n"
    assert main([*PLAN, "--emit-config", toml, "--force"]) == 0
    assert "[parallel]" in (tmp_path / "run.toml").read_text()
    assert (tmp_path / "run.plan.json").read_text() != "earlier\n"
    assert _mode(tmp_path / "run.toml") == _usual_mode()


def test_plan_plot_replaced_only_with_force_and_never_its_profile(tmp_path, capsys):
    png = tmp_path / "mem.png"
    png.write_bytes(b"earlier")
    _refused([*PLAN, "--plot", str(png)], capsys, "mem.png exists", "--force")
    assert png.read_bytes() == b"earlier"
    profile = tmp_path / "profile.json"
    profile.write_text("{}\n")
    _refused([*PLAN, "--hardware", str(profile), "--emit-config", str(profile), "--force"],
             capsys, "is also an input")
    assert profile.read_text() == "{}\n"


def test_simulate_save_and_png_need_force_a_trace_is_rewritten(tmp_path, capsys):
    saved, trace = tmp_path / "s.sched", tmp_path / "t.json"
    saved.write_text("earlier\n")
    trace.write_text("an earlier trace\n")
    _refused(["simulate", "--save", str(saved)], capsys, "s.sched exists", "--force")
    assert saved.read_text() == "earlier\n"
    assert main(["simulate", "--trace", str(trace)]) == 0  # traces keep their rule
    assert "traceEvents" in trace.read_text()
    assert main(["simulate", "--save", str(saved), "--force"]) == 0
    assert saved.read_text() != "earlier\n"


def test_calibrate_and_report_refuse_an_existing_output_without_force(tmp_path, capsys):
    from plait.observe.visuals import visual_problems

    profile = tmp_path / "p.json"
    profile.write_text("{}\n")
    _refused(["calibrate", "--out", str(profile)], capsys, "p.json exists", "--force")
    # --force lifts that refusal (a bad --ranks stops it before anything is measured)
    err = _refused(["calibrate", "--out", str(profile), "--ranks", "0", "--force"], capsys,
                   "--ranks 0")
    assert "exists" not in err and profile.read_text() == "{}\n"
    page = tmp_path / "r.html"
    page.write_text("earlier\n")
    args = argparse.Namespace(metrics=str(tmp_path / "m.jsonl"), config=None, plan=None,
                              html=str(page), png_dir=None, force=False)
    assert any("--force" in p for p in visual_problems(args))
    args.force = True
    assert not any("exists" in p for p in visual_problems(args))


# ---- the rule itself -------------------------------------------------------------------
def test_metrics_keep_their_rule_and_artifacts_get_the_new_one(tmp_path):
    old = tmp_path / "m.jsonl"
    old.write_text("{}\n")
    assert files.output_problems("--metrics-out", old) == []  # a rerun writes its metrics again
    assert "--force" in files.artifact_problems("--out", old)[0]
    assert files.artifact_problems("--out", old, force=True) == []
    broken = tmp_path / "dangling"
    broken.symlink_to(tmp_path / "nowhere")
    assert "exists" in files.artifact_problems("--out", broken)[0]
    inside = files.output_problems("--metrics-out", tmp_path / "d" / "m.jsonl", [tmp_path / "d"])
    assert "inside" in inside[0]
