"""Muon (plait/muon.py): the Newton-Schulz iteration against its definition, the update's
scale, the rule of which parameters are its matrices, the optimizer against the
single-process reference Muon (plait/train/reference.py), and the layouts it refuses."""

import pytest
import torch

from plait.config import ConfigError, load_config
from plait.model.presets import PRESETS
from plait.model.transformer import build_model
from plait.muon import (
    MUON_RULE,
    NS_COEFFICIENTS,
    MuonSettings,
    is_muon_matrix,
    muon_summary,
    orthogonalise,
    update_scale,
)
from plait.optim import MixedPrecisionAdamW
from plait.train.reference import ReferenceMuon, _optimizer

F64 = torch.float64


def conditioned(rows: int, cols: int, low: float, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A rows x cols matrix U diag(s) V^T with singular values s spread over [low, 1]."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=F64))
    s = torch.linspace(low, 1.0, k, dtype=F64)
    return u @ torch.diag(s) @ v.T, u, s, v


def quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The scalar polynomial each singular value goes through: x <- a x + b x^3 + c x^5."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return x


@pytest.mark.parametrize("shape", [(48, 48), (72, 24), (24, 72)])
def test_newton_schulz_maps_each_singular_value_through_the_quintic(shape):
    """In float64 the iteration is U p(s / (||G||_F + 1e-7)) V^T: the same singular
    vectors, each singular value through five steps of the quintic (wide and tall alike)."""
    g, u, s, v = conditioned(*shape, low=0.2)
    want = u @ torch.diag(quintic(s / (torch.linalg.norm(g) + 1e-7), 5)) @ v.T
    got = orthogonalise(g, F64)
    assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_newton_schulz_orthogonalises_a_well_conditioned_matrix(dtype):
    """Singular values of condition number 5 all land in the quintic's band around 1 after
    five steps ([0.68, 1.14] in exact arithmetic; bf16 rounds within [0.6, 1.2]), and the
    result is near U V^T: its direction, not its size."""
    g, u, _, v = conditioned(64, 32, low=0.2, seed=1)
    got = orthogonalise(g, dtype).to(F64)
    sv = torch.linalg.svdvals(got)
    assert sv.min() > 0.6 and sv.max() < 1.2, (sv.min(), sv.max())
    polar = u @ v.T
    assert torch.linalg.norm(got - polar) / torch.linalg.norm(polar) < 0.25


def test_newton_schulz_on_a_stack_is_each_matrix_on_its_own():
    """An expert stack (3-D): each expert's matrix orthogonalised alone, its own norm."""
    a, b = conditioned(16, 40, 0.3)[0], 5 * conditioned(16, 40, 0.3, seed=2)[0]
    got = orthogonalise(torch.stack([a, b]), F64)
    assert torch.equal(got[0], orthogonalise(a, F64))
    assert (got[1] - orthogonalise(b, F64)).abs().max() < 1e-13


def test_update_scale_is_moonlights_or_the_original():
    assert update_scale((64, 256), "moonlight") == pytest.approx(0.2 * 16)
    assert update_scale((8, 256, 64), "moonlight") == pytest.approx(0.2 * 16)  # a stack
    assert update_scale((256, 64), "original") == pytest.approx(2.0)
    assert update_scale((64, 256), "original") == 1.0
    with pytest.raises(ValueError, match="moonlight"):
        update_scale((4, 4), "spectral")


def test_the_rule_keeps_embedding_head_router_norms_on_adamw():
    model = build_model(PRESETS["tiny-moe"], seed=0, device="meta")
    on_muon = {n for n, p in model.named_parameters() if is_muon_matrix(n, p)}
    assert "layers.0.attn.wq.weight" in on_muon and "layers.0.mlp.experts.w1" in on_muon
    assert "layers.0.mlp.shared.w2.weight" in on_muon
    for kept in ("embed.weight", "head.weight", "layers.0.mlp.router.weight", "norm.weight",
                 "layers.0.attn_norm.weight"):
        assert kept not in on_muon
    note = muon_summary(model.named_parameters(), load_config().train)
    assert "embed.weight, layers.*.mlp.router.weight, head.weight" in note
    assert "embedding" in MUON_RULE and "router" in MUON_RULE


def _one_process_pair(preset: str, scale: str):
    """plait's optimizer and the reference's over two copies of one float64 model."""
    cfg = load_config(sets=["train.optimizer=muon", "train.muon_ns_dtype=fp64",
                            f"train.muon_scale={scale}", "train.precision=fp64"],
                      overrides={"model_name": preset})
    mine = build_model(cfg.model, seed=3, dtype=F64)
    theirs = build_model(cfg.model, seed=3, dtype=F64)
    t = cfg.train
    opt = MixedPrecisionAdamW(list(mine.named_parameters()), (t.beta1, t.beta2), t.eps,
                              t.weight_decay, kind="muon", muon=MuonSettings(
                                  t.muon_momentum, scale, "fp64"))
    ref = _optimizer(cfg, theirs)
    assert isinstance(ref, ReferenceMuon)
    return mine, theirs, opt, ref


@pytest.mark.parametrize("preset,scale", [("tiny", "moonlight"), ("tiny-moe", "original")])
def test_muon_matches_the_reference_muon(preset, scale):
    """Three updates with the same random gradients: every parameter, and every Muon
    matrix's momentum buffer, equal to the reference's to float64 rounding."""
    mine, theirs, opt, ref = _one_process_pair(preset, scale)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g, dtype=F64)
            q.grad = p.grad.clone()
        lr = 0.01 * (step + 1)
        opt.step(lr)
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
        ref.zero_grad()
    for (n, p), q in zip(mine.named_parameters(), theirs.parameters(), strict=True):
        assert (p - q).abs().max() < 1e-12, n
    name_of = {id(q): n for n, q in theirs.named_parameters()}
    want = {name_of[id(q)]: b for q, b in zip(ref.matrices, ref.buffers, strict=True)}
    names = [n for n, _ in mine.named_parameters()]
    got = {names[i]: buf for i, buf in zip(opt.muon_ids, opt.momentum, strict=True)}
    assert set(got) == set(want) and got
    for n, buf in got.items():
        assert (buf - want[n]).abs().max() < 1e-12, n


@pytest.mark.parametrize("sets,fix", [
    (["parallel.zero=1", "parallel.dp=2", "parallel.pp=2",
      "parallel.optimizer_sync=post_validation", "model.n_layers=4"],
     "use --optimizer-sync barrier"),
    (["parallel.tp=2", "parallel.zero=1"], "use --zero 0"),
    (["parallel.tp=2", "model.n_kv_heads=1"], "use a tp dividing the key/value heads"),
    (["train.muon_scale=rms"], "use 'moonlight' or 'original'"),
    (["train.muon_ns_dtype=fp16"], "use 'bf16', 'fp32' or 'fp64'"),
])
def test_unbuilt_layouts_and_bad_settings_are_refused_naming_the_fix(sets, fix):
    with pytest.raises(ConfigError, match=fix.replace("'", ".")):
        load_config(sets=["train.optimizer=muon", *sets]).check()


def _inputs(tmp_path, *flags: str):
    import argparse

    from helpers import token_file

    from plait.train.checks import train_inputs
    from plait.train.flags import add_train_args

    parser = argparse.ArgumentParser()
    add_train_args(parser)
    return train_inputs(parser.parse_args(["--data", str(token_file()), "--set",
                                           "model.vocab_size=256", "--seq-len", "32",
                                           *flags]))


def test_the_flags_set_muon(tmp_path):
    found = _inputs(tmp_path, "--optimizer", "muon", "--muon-scale", "original",
                    "--muon-ns-dtype", "fp32")
    assert found.problems == []
    t = found.cfg.train
    assert (t.optimizer, t.muon_scale, t.muon_ns_dtype) == ("muon", "original", "fp32")
    assert _inputs(tmp_path, "--optimizer", "sgd", "--set",
                   "train.weight_decay=0").problems == []  # sgd keeps its name
