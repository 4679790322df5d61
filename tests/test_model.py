"""Model-level checks that do not go through the single-process reference.

Parity compares every layout with a reference that runs the same model code
(plait/model/transformer.py, presets.py) and the same `lr_at`, so a bug there cancels out.
These tests hold that code to independent formulas, hand-computed values and published
parameter counts. Single process, CPU, a few seconds.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import config

from plait.model.presets import PRESETS, ModelConfig
from plait.model.rope import Positions, apply_rope, rope_tables
from plait.model.transformer import Attention, RMSNorm, build_model
from plait.train.lr_schedule import lr_at

SEED = 1234


def tiny() -> ModelConfig:
    return config().model  # vocab 256, dim 64, 2 layers, 4 heads


def complex_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE written independently (Su et al. 2021): pairs (x[2i], x[2i+1]) as complex
    numbers times exp(i * pos * theta^(-2i/d)); x is (..., seq, head_dim)."""
    d, s = x.shape[-1], x.shape[-2]
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(s, d // 2, dtype=torch.float64),
                      torch.arange(s, dtype=torch.float64)[:, None] * freq)
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


# --- attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("gqa", [False, True])
def test_attention_is_causal(gqa):
    """Catches a missing or wrong causal mask (is_causal dropped, mask off by one, a
    transposed mask): changing the token at position t must leave every logit at positions
    < t unchanged, and change logits at t and later."""
    cfg = tiny() if not gqa else dataclasses.replace(tiny(), n_kv_heads=2)
    model = build_model(cfg, SEED).eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=gen)
    with torch.no_grad():
        base = model(tokens)
        for t in (0, 5, 17, 31):
            changed = tokens.clone()
            changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
            assert (out[:, t:] - base[:, t:]).abs().max() > 1e-4, t


def test_attention_matches_naive_softmax_with_gqa():
    """Catches a wrong attention scale (1/d instead of 1/sqrt(d), or none), a wrong GQA head
    grouping (kv heads tiled instead of repeated per group), a wrong mask, or RoPE applied
    to v: one Attention forward against softmax(q k^T / sqrt(d) + causal mask) v written
    out by hand with the module's own weights and an independent RoPE."""
    cfg = dataclasses.replace(tiny(), n_heads=4, n_kv_heads=2)
    attn = Attention(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.3)
    b, s, d = 2, 12, cfg.head_dim
    x = torch.randn(b, s, cfg.dim, generator=gen)
    cos, sin = rope_tables(d, s, cfg.rope_theta)
    with torch.no_grad():
        got = attn(x, Positions(None, cos, sin))
        q = (x @ attn.wq.weight.T).view(b, s, cfg.n_heads, d).transpose(1, 2)
        k = (x @ attn.wk.weight.T).view(b, s, cfg.n_kv_heads, d).transpose(1, 2)
        v = (x @ attn.wv.weight.T).view(b, s, cfg.n_kv_heads, d).transpose(1, 2)
        q, k = complex_rope(q, cfg.rope_theta), complex_rope(k, cfg.rope_theta)
        group = cfg.n_heads // cfg.n_kv_heads  # query head h reads kv head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        future = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        want = out.transpose(1, 2).reshape(b, s, -1) @ attn.wo.weight.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- RoPE -----------------------------------------------------------------------------------


def test_rope_dot_product_depends_only_on_relative_position():
    """Catches RoPE tables or rotation that are not a rotation by pos * freq (wrong sign of
    sin, cos/sin swapped, frequencies indexed by pair vs by dim): <R_m q, R_n k> must
    depend on m - n only."""
    d, s, theta = 16, 64, 10000.0
    cos, sin = rope_tables(d, s, theta)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    rq = apply_rope(q.expand(1, 1, s, d).contiguous(), cos, sin)[0, 0]  # q at every position
    rk = apply_rope(k.expand(1, 1, s, d).contiguous(), cos, sin)[0, 0]
    for shift in (0, 1, 3, 10, -7):
        dots = torch.stack([rq[m] @ rk[m - shift] for m in range(max(shift, 0),
                                                               min(s, s + shift))])
        assert (dots - dots[0]).abs().max() < 1e-5 * max(1.0, float(dots.abs().max())), shift
    # and the dependence is real: different shifts give different dot products
    assert abs(float(rq[10] @ rk[10]) - float(rq[10] @ rk[7])) > 1e-3


def test_rope_matches_complex_pairs():
    """Catches a different pairing convention (halves (x[i], x[i+d/2]) instead of adjacent
    pairs (x[2i], x[2i+1])), a wrong frequency exponent, or a reversed rotation: apply_rope
    against the complex-number form written in this file."""
    d, s = 16, 40
    for theta in (10000.0, 500000.0):
        cos, sin = rope_tables(d, s, theta)
        x = torch.randn(2, 3, s, d, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(apply_rope(x, cos, sin), complex_rope(x, theta),
                                   rtol=1e-5, atol=1e-5)


# --- norm, init -----------------------------------------------------------------------------


def test_rmsnorm_formula():
    """Catches RMSNorm computed as LayerNorm (mean subtracted), eps outside the sqrt, the
    gain not applied, or a normalisation over the wrong dimension."""
    dim, eps = 24, 1e-5
    norm = RMSNorm(dim, eps)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    x = torch.randn(3, 5, dim, generator=gen) * 3 + 1  # non-zero mean: LayerNorm would differ
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * norm.weight
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)
    small = torch.full((1, dim), 1e-4)  # where eps matters: rms^2 = 1e-8 << eps
    want = small / math.sqrt(1e-8 + eps) * norm.weight
    torch.testing.assert_close(norm(small), want, rtol=1e-6, atol=1e-9)


def test_initial_loss_is_ln_vocab():
    """Catches an init that is far too large (std not applied, output projections not
    scaled) or a head that is not initialised: a fresh model should be close to uniform
    over the vocabulary, mean cross-entropy ~ ln V."""
    cfg = tiny()
    model = build_model(cfg, SEED).eval()
    tokens = torch.randint(0, cfg.vocab_size, (8, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
    # measured 5.5520 against ln 256 = 5.5452 (+0.12 %)
    assert float(loss) == pytest.approx(math.log(cfg.vocab_size), rel=0.02)


# --- learning-rate schedule -----------------------------------------------------------------


def test_lr_at_table():
    """Catches an off-by-one in warm-up (starting at 0, or reaching base a step late), a
    cosine that decays to 0 instead of base*min_ratio, a half-period error, or a schedule
    that goes on past the end. Values computed by hand for base 3e-3, warm-up 4, total 20,
    min ratio 0.1 (decay span 16)."""
    base, warmup, total, ratio = 3e-3, 4, 20, 0.1
    table = {
        0: 7.5e-4,  # base * 1/4
        1: 1.5e-3,  # base * 2/4
        3: 3e-3,  # base * 4/4: warm-up ends at base
        4: 3e-3,  # cosine progress 0
        8: 2.6045941546e-3,  # progress 1/4: base * (0.1 + 0.45 * (1 + cos(pi/4)))
        12: 1.65e-3,  # midpoint: base * (0.1 + 0.45)
        20: 3e-4,  # end: base * min_ratio
        21: 3e-4,  # past the end: held
        100: 3e-4,
    }
    for step, want in table.items():
        assert lr_at(step, base, warmup, total, ratio) == pytest.approx(want, rel=1e-9), step
    assert lr_at(0, base, 0, total, ratio) == pytest.approx(base)  # no warm-up
    assert lr_at(5, base, 0, 5, 0.0) == 0.0  # decays to zero with min ratio 0


# --- parameter counts -----------------------------------------------------------------------

# Published totals. Llama 3: shapes from Dubey et al. 2024, "The Llama 3 Herd of Models",
# Table 3; totals 8.03B / 70.6B / 405.9B from Meta's model cards. GPT-3 175B: Brown et al.
# 2020, Table 2.1 (175.0B). The smaller GPT-3 rows are rounded to 2-3 digits and GPT-3 ties
# its embeddings where the presets do not, so they are not held here.
PUBLISHED = {
    "llama3-8b": 8.03e9,  # ours 8,030,261,248
    "llama3-70b": 70.6e9,  # ours 70,553,706,496 (-0.07 %)
    "llama3-405b": 405.9e9,  # ours 405,853,388,800 (-0.01 %)
    "gpt3-175b": 175.0e9,  # ours 175,183,663,104 (+0.10 %)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_param_counts_match_published(name):
    """Catches a wrong preset shape (a typo in dim, ffn_dim, layers or KV heads) or a
    num_params formula that misses or double-counts a term, for the real shapes the
    planner reasons about."""
    assert PRESETS[name].num_params() == pytest.approx(PUBLISHED[name], rel=0.01)


SHAPES = {
    "tiny": PRESETS["tiny"],
    "tiny-gqa": PRESETS["tiny-gqa"],
    "tied": dataclasses.replace(PRESETS["tiny"], tie_embeddings=True),
    "odd": ModelConfig(vocab_size=1000, dim=96, n_layers=3, n_heads=6, n_kv_heads=2,
                       ffn_dim=250),
    "llama3-8b": PRESETS["llama3-8b"],
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_num_params_counts_the_built_model(name):
    """Catches num_params drifting from the module it describes (GQA's smaller wk/wv, the
    norm gains, the tied head counted twice or not at all): the formula must equal the
    numel of the parameters of the model built on the meta device."""
    cfg = SHAPES[name]
    model = build_model(cfg, SEED, device="meta")
    built = sum(p.numel() for p in model.parameters())  # a tied weight is listed once
    assert cfg.num_params() == built
    no_emb = built - model.embed.weight.numel()
    if not cfg.tie_embeddings:
        no_emb -= model.head.weight.numel()
    assert cfg.num_params(include_embedding=False) == no_emb
