"""Configuration: TOML + overrides, and validation that reports every problem with its fix."""

import dataclasses

import pytest

from plait.config import Config, ConfigError, load_config


def test_toml_then_flags_then_set(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('model = "tiny-gqa"\n[train]\nlr = 0.5\nsteps = 7\n[parallel]\ndp = 2\n'
                 'order = ["tp", "cp", "pp", "dp"]\n')
    cfg = load_config(f, overrides={"train.steps": 9, "train.seed": None},
                      sets=["train.lr=0.25", "model.n_layers=3", "parallel.bucket_mb=1.5"])
    assert cfg.model_name == "tiny-gqa" and cfg.model.n_kv_heads == 2
    assert cfg.model.n_layers == 3 and cfg.train.lr == 0.25 and cfg.train.steps == 9
    assert cfg.parallel.dp == 2 and cfg.parallel.bucket_mb == 1.5
    assert cfg.train.seed == Config().train.seed  # None means "flag not given"


def test_unknown_keys_and_presets_named():
    with pytest.raises(ConfigError, match="train has: .*lr"):
        load_config(sets=["train.learning_rate=1"])
    with pytest.raises(ConfigError, match="known: tiny"):
        load_config(overrides={"model_name": "gpt-9"})
    with pytest.raises(ConfigError, match="must look like"):
        load_config(sets=["train.lr"])


def test_every_problem_reported_at_once():
    cfg = load_config(sets=["parallel.dp=3", "train.global_batch=8", "train.seq_len=4096",
                            "parallel.tp=3", "parallel.zero=5", "train.precision=fp16"])
    problems = cfg.validate(world_size=4)
    text = "\n".join(problems)
    assert "does not match the world size 4" in text
    assert "not divisible by dp=3; use a multiple of 3" in text
    assert "longer than the model's max_seq_len=256" in text
    assert "tp=3 does not divide model.n_heads=4; use tp in 1, 2, 4" in text
    assert "parallel.zero=5 is not a ZeRO stage; use 0, 1, 2 or 3" in text
    assert "train.precision='fp16'" in text
    assert len(problems) >= 6


def test_microbatches_derived_once():
    cfg = load_config(sets=["parallel.dp=2", "train.global_batch=16",
                            "train.micro_batch_size=2"]).check(2)
    assert cfg.microbatches() == 4 and cfg.micro_batch_size() == 2
    cfg = load_config(sets=["parallel.dp=2", "train.global_batch=16",
                            "parallel.microbatches=2"]).check(2)
    assert cfg.micro_batch_size() == 4
    bad = load_config(sets=["parallel.dp=2", "train.global_batch=16", "parallel.microbatches=2",
                            "train.micro_batch_size=2"])
    assert any("disagree" in p and "set only one" in p for p in bad.validate(2))
    bad = load_config(sets=["parallel.dp=2", "train.global_batch=16", "parallel.microbatches=3"])
    assert any("use one of 1, 2, 4, 8" in p for p in bad.validate(2))


def test_unbuilt_strategies_refused_not_ignored():
    problems = load_config(sets=["parallel.ep=2", "parallel.dp=2"]).validate(2)
    assert any("needs an MoE model" in p for p in problems)  # ep on a dense model
    assert load_config(overrides={"model_name": "tiny-moe"}, sets=["parallel.dp=2",
                                                          "parallel.ep=2"]).validate(2) == []
    assert load_config(sets=["parallel.cp=2"]).validate(2) == []  # context parallel runs now
    assert load_config(sets=["parallel.pp=2"]).validate(2) == []  # pipelines run now
    cfg = load_config(sets=["parallel.zero=1"])
    assert cfg.validate(1) == [] and "does nothing" in cfg.warnings()[0]


def test_model_flag_replaces_the_config_files_model_table(tmp_path):
    """`plait train --config run8b.toml --model tiny`: the file `plait plan --emit-config`
    writes (a preset name and every [model] field) loses to the flags, --model wholly."""
    import argparse

    from plait.model.presets import PRESETS
    from plait.train.flags import add_train_args, config_from_args

    f = tmp_path / "run8b.toml"
    f.write_text('model_name = "llama3-8b"\n[model]\nvocab_size = 128256\ndim = 4096\n'
                 'n_layers = 32\nmax_seq_len = 8192\n[parallel]\ndp = 8\nzero = 3\n'
                 '[train]\nglobal_batch = 64\nseq_len = 8192\nsteps = 100\n')
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    args = parser.parse_args(["--config", str(f), "--model", "tiny", "--steps", "3",
                              "--dp", "2", "--set", "model.n_layers=4"])
    cfg = config_from_args(args)
    assert cfg.model_name == "tiny"
    assert cfg.model == dataclasses.replace(PRESETS["tiny"], n_layers=4)
    assert (cfg.train.steps, cfg.parallel.dp) == (3, 2)  # flags over the file
    assert (cfg.parallel.zero, cfg.train.seq_len) == (3, 8192)  # the file over defaults
    alone = config_from_args(parser.parse_args(["--config", str(f)]))
    assert alone.model_name == "llama3-8b" and alone.model.dim == 4096


def test_zero3_gather_setting_flag_and_its_check():
    """`--zero3-gather step` sets parallel.zero3_gather; a value that is not a choice is
    refused before any rank starts, naming the choices."""
    import argparse

    from plait.train.flags import add_train_args, config_from_args

    parser = argparse.ArgumentParser()
    add_train_args(parser)
    cfg = config_from_args(parser.parse_args(["--zero", "3", "--dp", "2",
                                              "--zero3-gather", "step"]))
    assert cfg.parallel.zero3_gather == "step" and cfg.validate(2) == []
    assert Config().parallel.zero3_gather == "microbatch"
    problems = load_config(sets=["parallel.zero3_gather=layer"]).validate(1)
    assert problems == ["parallel.zero3_gather='layer'; use one of 'microbatch', 'step'"]
