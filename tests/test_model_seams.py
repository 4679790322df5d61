"""The model's seams: what later strategies plug into, checked on one process.

Positions (RoPE and the causal mask from token positions, as context parallel's
out-of-order chunks need), the swappable attention core, the RoPE cache, the MLP factory
and its auxiliary-loss path, the one layer loop (model and pipeline stage) and the one
materialisation. A few seconds, CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import config
from torch import nn

from plait.model import loss as model_loss
from plait.model.moe import MoE
from plait.model.presets import PRESETS, ModelConfig
from plait.model.recompute import Recompute
from plait.model.rope import Positions, RotaryEmbedding, rope_tables
from plait.model.transformer import (
    CausalAttentionCore,
    SwiGLU,
    Transformer,
    build_model,
    init_full_param,
    make_mlp,
    materialise,
)
from plait.parallel.pipeline.partition import Stage

SEED = 11


def tiny(**over) -> ModelConfig:
    return dataclasses.replace(config().model, **over)


def _tokens(cfg: ModelConfig, b: int = 2, s: int = 32) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))


def _balanced_order(s: int, cp: int) -> torch.Tensor:
    """Context parallel's load balance: 2cp chunks, rank r holds chunks r and 2cp-1-r;
    the ranks' tokens concatenated in rank order."""
    chunks = torch.arange(s).chunk(2 * cp)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


# --- positions ------------------------------------------------------------------------------


def test_default_positions_are_the_contiguous_tables_bit_for_bit():
    """Catches a cache that changes RoPE's numbers: the rotation a default forward gets is
    today's `rope_tables(d, s)` exactly, for any s up to and past max_seq_len."""
    cfg = tiny()
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_seq_len)
    for s in (1, 7, 32, cfg.max_seq_len, cfg.max_seq_len + 5):
        pos = rope(s, "cpu")
        cos, sin = rope_tables(cfg.head_dim, s, cfg.rope_theta)
        assert pos.contiguous and torch.equal(pos.cos, cos) and torch.equal(pos.sin, sin)
        assert torch.equal(pos.index(), torch.arange(s))


def test_explicit_contiguous_positions_equal_the_default():
    """Catches a positional mask that differs from the causal triangle (off by one,
    transposed): 0..s-1 given explicitly (the mask path) matches is_causal."""
    cfg = tiny(n_kv_heads=2)
    model = build_model(cfg, SEED).eval()
    tokens = _tokens(cfg)
    with torch.no_grad():
        base = model(tokens)
        torch.testing.assert_close(model(tokens, positions=torch.arange(32)), base,
                                   rtol=1e-5, atol=1e-5)
        rows = torch.arange(32).expand(2, 32)  # (batch, seq) positions
        torch.testing.assert_close(model(tokens, positions=rows), base, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_out_of_order_chunks_with_their_positions_equal_the_sequence(recompute):
    """Catches a mask or rotation taken from the order of the tokens rather than their
    positions: context parallel's load-balanced chunk order, tokens and positions permuted
    together, gives the permuted logits and the same gradients."""
    cfg = tiny()
    model = build_model(cfg, SEED)
    model.recompute = Recompute.of(recompute)
    tokens = _tokens(cfg)
    order = _balanced_order(32, cp=2)
    base = model(tokens)
    base.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = model(tokens[:, order], positions=order)
    torch.testing.assert_close(got, base[:, order], rtol=1e-5, atol=1e-5)
    got.square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)
    # a different order per row: (batch, seq) positions
    per_row = torch.stack([order, torch.arange(32).flip(0)])
    with torch.no_grad():
        got = model(torch.stack([tokens[0, per_row[0]], tokens[1, per_row[1]]]),
                    positions=per_row)
    for r in range(2):
        torch.testing.assert_close(got[r], base[r, per_row[r]].detach(), rtol=1e-5, atol=1e-5)


def test_attention_core_is_a_parameter_free_swappable_module():
    """Catches a core that owns parameters (names would change) or an attention that does
    not route through `attn.core`: a swapped-in core sees every layer's q, k, v and
    positions, and the parameter names stay the model's."""
    cfg = tiny()
    model = build_model(cfg, SEED).eval()
    names = [n for n, _ in model.named_parameters()]
    assert all(".core." not in n for n in names) and "layers.1.attn.wq.weight" in names
    assert list(model.state_dict()) == names  # no buffers: the RoPE cache is not state

    class Recording(CausalAttentionCore):
        def __init__(self, seen):
            super().__init__()
            self.seen = seen

        def forward(self, q, k, v, positions):
            self.seen.append((q.shape, k.shape, positions))
            return super().forward(q, k, v, positions)

    tokens = _tokens(cfg)
    with torch.no_grad():
        base = model(tokens)
        seen = []
        for layer in model.layers:
            layer.attn.core = Recording(seen)
        assert torch.equal(model(tokens), base)
    assert len(seen) == cfg.n_layers
    assert all(isinstance(p, Positions) and p.contiguous for *_, p in seen)


# --- RoPE cache -----------------------------------------------------------------------------


def test_rope_cache_is_built_at_materialisation_and_reused():
    """Catches tables rebuilt every forward or cast with the model: one fp32 table per
    device, built by materialise, reused by every forward (and shared by a stage)."""
    cfg = tiny()
    assert build_model(cfg, SEED, device="meta").rope._tables == {}
    model = build_model(cfg, SEED, dtype=torch.bfloat16)
    (key, tables), = model.rope._tables.items()
    assert key == (torch.device("cpu"), cfg.max_seq_len)
    assert all(t.dtype == torch.float32 for t in tables)
    with torch.no_grad():
        model(_tokens(cfg))
        model(_tokens(cfg, s=cfg.max_seq_len))
    assert model.rope._tables == {key: tables}  # nothing new, the same tensors
    assert Stage(model, (0, cfg.n_layers), True, True).rope is model.rope


# --- MLP factory and auxiliary loss ---------------------------------------------------------


def test_make_mlp_is_dense_swiglu_or_moe_by_layer():
    cfg = tiny()
    mlp = make_mlp(cfg)
    assert isinstance(mlp, SwiGLU) and mlp.w1.out_features == cfg.ffn_dim
    assert mlp.aux_loss is None
    moe = dataclasses.replace(PRESETS["tiny"], n_experts=4, top_k=2, expert_ffn_dim=64,
                              n_layers=3, n_dense_layers=1)
    assert isinstance(make_mlp(moe, 0), SwiGLU) and isinstance(make_mlp(moe, 1), MoE)
    kinds = [type(b.mlp).__name__ for b in Transformer(moe).layers]
    assert kinds == ["SwiGLU", "MoE", "MoE"]  # the first n_dense_layers stay dense


class ToyMoE(nn.Module):
    """A stand-in MLP that reports an auxiliary loss: a gate whose mean square is the loss."""

    def __init__(self, dense: nn.Module, dim: int):
        super().__init__()
        self.dense = dense
        self.gate = nn.Linear(dim, 2, bias=False)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux_loss = self.gate(x).square().mean()
        return self.dense(x)


def _with_toy_mlps(cfg: ModelConfig) -> Transformer:
    model = build_model(cfg, SEED)
    torch.manual_seed(0)
    for layer in model.layers:
        layer.mlp = ToyMoE(layer.mlp, cfg.dim)
    return model


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_aux_losses_reach_the_collector_and_train_the_router(recompute):
    """Catches an aux-loss path that drops losses, collects them twice under recompute, or
    detaches them: one loss per block in block order, each backpropagating to its gate;
    the same through a pipeline stage; a dense model reports none."""
    cfg = tiny(n_layers=3)
    model = _with_toy_mlps(cfg)
    model.recompute = Recompute.of(recompute)
    tokens = _tokens(cfg)
    aux: list[torch.Tensor] = []
    logits = model(tokens, aux_losses=aux)
    assert len(aux) == cfg.n_layers
    assert [a is layer.mlp.aux_loss for a, layer in zip(aux, model.layers)] == [True] * 3
    (logits.mean() + sum(aux)).backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.layers)
    model.zero_grad(set_to_none=True)

    stage_aux: list[torch.Tensor] = []
    s0 = Stage(model, (0, 1), first=True, last=False)
    s1 = Stage(model, (1, 3), first=False, last=True)
    out = s1(s0(tokens, aux_losses=stage_aux), aux_losses=stage_aux)
    torch.testing.assert_close(out, logits.detach(), rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(stage_aux), torch.stack(aux).detach(),
                               rtol=0, atol=0)

    dense: list[torch.Tensor] = []
    with torch.no_grad():
        build_model(cfg, SEED)(tokens, aux_losses=dense)
    assert dense == []


# --- one loop, one materialisation, the loss in the model layer ------------------------------


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_stages_run_the_models_loop_bit_for_bit(recompute):
    """Catches a stage loop that drifts from the model's: the whole model as one stage,
    and cut in two, give the model's logits exactly."""
    cfg = tiny(n_layers=3)
    model = build_model(cfg, SEED)
    model.recompute = Recompute.of(recompute)
    tokens = _tokens(cfg)
    want = model(tokens)
    whole = Stage(model, (0, 3), first=True, last=True)
    whole.recompute = Recompute.of(recompute)
    assert torch.equal(whole(tokens), want)
    s0, s1 = Stage(model, (0, 2), True, False), Stage(model, (2, 3), False, True)
    assert torch.equal(s1(s0(tokens)), want)


def test_materialise_fills_name_seeded_init_on_a_device_and_reties():
    """Catches a materialisation that loses the tied head, initialises by position rather
    than by name, or ignores the device and dtype it is given."""
    cfg = tiny(tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(cfg)
    out = materialise(model, cfg, SEED, torch.bfloat16, device=torch.device("cpu"))
    assert out is model and model.head.weight is model.embed.weight
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16
        assert torch.equal(p, init_full_param(name, p.shape, cfg, SEED).to(torch.bfloat16))
    built = build_model(cfg, SEED, dtype=torch.bfloat16)
    assert {n: p for n, p in built.named_parameters()}.keys() == dict(
        model.named_parameters()).keys()


def test_token_loss_lives_in_the_model_layer():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1),
                                             reduction="sum") / 40
    torch.testing.assert_close(model_loss.token_loss(logits, targets, 40), want)
