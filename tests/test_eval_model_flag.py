"""`plait eval --model`: the model to evaluate comes from --init-from; a preset given beside
it is checked against what the source holds, accepted when it is that model and refused,
saying so, when it is another (not answered with a close flag's name)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import token_file

from plait.checkpoint import Checkpointing
from plait.cli.main import main
from plait.config import load_config
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.train.data import GlobalBatches, TokenFile
from plait.train.loop import TrainOptions, train

SETS = ["train.steps=1", "train.global_batch=8", "train.seq_len=32"]


def _save_tiny(rank: int, world: int, directory: str) -> None:
    cfg = load_config(overrides={"model_name": "tiny"}, sets=SETS).check(world)
    batches = GlobalBatches(TokenFile.open(token_file()), 32, 8, cfg.train.seed,
                            cfg.model.vocab_size)
    train(cfg, ParallelMesh.build(cfg.parallel), batches,
          TrainOptions(checkpoint=Checkpointing(dir=Path(directory), every=1)))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ck")
    token_file()
    run_ranks(_save_tiny, 1, str(directory))
    return directory


def _eval(capsys, *extra: str) -> tuple[int, str]:
    try:
        code = main(["eval", "--data", str(token_file()), "--seq-len", "32",
                     "--global-batch", "8", "--eval-sequences", "8", *extra])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.err + out.out


def test_a_preset_that_is_the_sources_model_is_accepted(tiny_checkpoint, capsys):
    code, plain = _eval(capsys, "--init-from", str(tiny_checkpoint))
    assert code == 0, plain
    code, named = _eval(capsys, "--init-from", str(tiny_checkpoint), "--model", "tiny")
    assert code == 0, named
    assert named.split("loss ")[1] == plain.split("loss ")[1]  # the same model, same loss


def test_another_preset_is_refused_naming_init_from(tiny_checkpoint, capsys):
    code, text = _eval(capsys, "--init-from", str(tiny_checkpoint), "--model", "tiny-gqa")
    assert code == 2, text
    assert "--model tiny-gqa: the model comes from --init-from" in text
    assert "n_kv_heads=4 (--model tiny-gqa: 2)" in text and "leave out --model" in text
    assert "did you mean" not in text
