"""Configuration: TOML + overrides, and validation that reports every problem with its fix."""

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
                            "parallel.tp=3", "parallel.zero=5", "train.precision=fp8"])
    problems = cfg.validate(world_size=4)
    text = "\n".join(problems)
    assert "does not match the world size 4" in text
    assert "not divisible by dp=3; use a multiple of 3" in text
    assert "longer than the model's max_seq_len=256" in text
    assert "tp=3 does not divide model.n_heads=4; use tp in 1, 2, 4" in text
    assert "parallel.zero=5 is not a ZeRO stage; use 0, 1, 2 or 3" in text
    assert "train.precision='fp8'" in text
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
