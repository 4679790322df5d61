"""Multi-head latent attention (plait/model/mla.py): the block against its formula written
out independently, causality, the published DeepSeek-V3 counts, its configuration checks,
and context parallel's core at a value width other than the key's. Parity of every layout
is the matrix's (tests/matrix.py, MLA_ROWS)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import config
from test_model import complex_rope

from plait.config import ConfigError, load_config
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.mla import LatentAttention
from plait.model.presets import PRESETS
from plait.model.rope import Positions
from plait.model.transformer import build_model, materialise
from plait.parallel.context import ContextLayout, ContextParallelAttention
from plait.plan.shape import from_preset

SEED = 11
MLA = PRESETS["tiny-mla"]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def naive_mla(attn: LatentAttention, x: torch.Tensor, cfg) -> torch.Tensor:
    """DeepSeek-V2 section 2.1 in float64, head by head, with its own RoPE (complex pairs)
    and an explicit causal softmax at scale 1/sqrt(qk_nope + qk_rope)."""
    w = {n: p.detach().double() for n, p in attn.named_parameters()}
    x = x.double()
    eps, nope, rope, dv = cfg.norm_eps, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank:
        q = _rms(x @ w["wq_a.weight"].T, w["q_norm.weight"], eps) @ w["wq_b.weight"].T
    else:
        q = x @ w["wq.weight"].T
    ckv = x @ w["wkv_a.weight"].T
    latent, k_rope = ckv[..., :cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
    kv = _rms(latent, w["kv_norm.weight"], eps) @ w["wkv_b.weight"].T
    k_rope = complex_rope(k_rope, cfg.rope_theta)  # (b, s, rope): one key for every head
    s = x.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    heads = []
    for i in range(cfg.n_heads):
        qi = q[..., i * (nope + rope):(i + 1) * (nope + rope)]
        qi = torch.cat([qi[..., :nope], complex_rope(qi[..., nope:], cfg.rope_theta)], -1)
        kvi = kv[..., i * (nope + dv):(i + 1) * (nope + dv)]
        ki = torch.cat([kvi[..., :nope], k_rope], -1)
        scores = (qi @ ki.transpose(-1, -2)) / (nope + rope) ** 0.5
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        heads.append(p @ kvi[..., nope:])
    return torch.cat(heads, -1) @ w["wo.weight"].T


@pytest.mark.parametrize("q_lora", [32, 0], ids=["query-latent", "no-query-latent"])
def test_latent_attention_equals_its_formula(q_lora):
    """Catches RoPE on the wrong features or a key rotated per head, the latent norms
    skipped, the heads' [nope | rope] or [k | v] blocks read in another order, a scale of
    the nope width only, a missing causal mask."""
    cfg = dataclasses.replace(MLA, q_lora_rank=q_lora)
    with torch.device("meta"):
        attn = LatentAttention(cfg)
    attn = materialise(attn, cfg, SEED)
    with torch.no_grad():  # the latent norms' gains away from one, so they are exercised
        for name in ("q_norm", "kv_norm"):
            if hasattr(attn, name):
                getattr(attn, name).weight.uniform_(0.5, 1.5)
    b, s = 2, 12
    x = torch.randn(b, s, cfg.dim, generator=torch.Generator().manual_seed(0))
    rope = build_model(cfg, SEED, device="meta").rope
    rope.warm("cpu")
    with torch.no_grad():
        got = attn(x, rope(s, "cpu"))
    torch.testing.assert_close(got.double(), naive_mla(attn, x, cfg), rtol=1e-5, atol=1e-6)


def test_model_is_causal_and_counts_its_parameters():
    model = build_model(MLA, SEED).eval()
    assert sum(p.numel() for p in model.parameters()) == MLA.num_params()
    assert model.rope.head_dim == MLA.qk_rope_head_dim
    tokens = torch.randint(0, MLA.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(tokens)
        changed = tokens.clone()
        changed[:, 10] = (changed[:, 10] + 1) % MLA.vocab_size
        out = model(changed)
    torch.testing.assert_close(out[:, :10], base[:, :10], rtol=0, atol=1e-6)
    assert (out[:, 10:] - base[:, 10:]).abs().max() > 1e-4


def test_deepseek_v3_is_the_published_model():
    """DeepSeek-V3 technical report (abstract, section 2; its Hugging Face model card):
    671 B parameters, 37 B activated per token, 685 B with the 14 B multi-token prediction
    module as stored. plait counts 671.03 B, 684.49 B with one MTP module (its own copies
    of the embedding and head counted, as the checkpoint stores them: 13.46 B, which the
    card rounds to 14) and 37.55 B activated (embedding and head included)."""
    ds = PRESETS["deepseek-v3"]
    assert ds.num_params() == 671_026_404_352
    assert abs(ds.num_params() / 671e9 - 1) < 1e-3
    with_mtp = dataclasses.replace(ds, mtp_depth=1).num_params(mtp=True)
    assert abs(with_mtp / 685e9 - 1) < 1e-3
    assert 13e9 < ds.mtp_params() < 14e9
    h, moe_layers = ds.dim, ds.n_layers - ds.n_dense_layers
    inactive = moe_layers * (ds.n_experts - ds.top_k) * 3 * h * ds.expert_ffn_dim
    assert 37e9 <= ds.num_params() - inactive < 38e9
    # the planner's shape counts the same, and reads the MLA widths
    assert from_preset("deepseek-v3").num_params() == ds.num_params()
    assert from_preset("deepseek-v3").kv_exchange_dim == 128 * (192 + 128)


def test_mla_settings_are_checked():
    bad = ["model_name=tiny-mla", "model.n_kv_heads=2", "model.qk_rope_head_dim=7",
           "model.kv_lora_rank=0", "model.mtp_depth=1", "model.routed_scale=0"]
    with pytest.raises(ConfigError) as e:
        load_config(sets=bad).check(1)
    text = str(e.value)
    for fix in ("set model.n_kv_heads=4", "qk_rope_head_dim=7 must be even",
                "kv_lora_rank=0 must be >= 1", "set model.mtp_depth=0",
                "routed_scale=0.0 must be > 0"):
        assert fix in text, (fix, text)
    with pytest.raises(ConfigError, match="model.attention='latent'"):
        load_config(sets=["model.attention=latent"]).check(1)
    config("model_name=tiny-mla").check(1)  # the preset itself is valid


def _narrow_values(rank, world, cases):
    mesh = ParallelMesh.build(load_config(sets=[f"parallel.cp={world}"]).parallel)
    b, h, s, dk, dv = 2, 4, 16, 24, 8
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, s, dk, generator=gen) for _ in range(2))
    v, dout = (torch.randn(b, h, s, dv, generator=gen) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)
    errs = []
    for mode, fused in cases:
        lay = ContextLayout(world, s, "zigzag")
        core = ContextParallelAttention(mesh, lay, mode, fused=fused)
        pos = lay.positions(mesh.coord("cp"), "cpu")
        mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        out = core(*mine, Positions(pos, torch.zeros(1), torch.zeros(1)))
        out.backward(dout[:, :, pos])
        diffs = [(out - ref[:, :, pos]).abs().max()]
        diffs += [(a.grad - r.grad[:, :, pos]).abs().max() for a, r in zip(mine, full,
                                                                           strict=True)]
        errs.append(max(float(d) for d in diffs))
    return errs


def test_context_parallel_core_with_values_narrower_than_keys():
    """MLA's per-head values (v_head_dim) are narrower than its queries and keys: the ring
    (fused CPU kernel, which takes one width, and the eager maths) and the all-gather give
    causal attention's output and gradients (tolerance as tests/test_context_parallel.py's
    CORE_ATOL)."""
    cases = [("ring", None), ("ring", False), ("allgather", None)]
    for rank_errs in run_ranks(_narrow_values, 2, cases):
        for case, err in zip(cases, rank_errs, strict=True):
            assert err <= 1e-5, (case, err)


def test_plan_answers_deepseek_v3_on_2048_h800():
    """`plait plan --model deepseek-v3 --gpus 2048 --gpu h800 --overlap-fb` (docs/
    deepseek.md: DualPipe's overlap, which the runtime performs with it): the paper's batch
    (15360 sequences) when none is given, a layout that fits an H800 with its bubble and why,
    its tokens/s per GPU printed beside the paper's 1,543 (1e12 / (180e3 x 3600)), and
    the context-parallel line's price of the chosen mode equal to the layout's row."""
    import json
    import re

    from test_plan_flops import plan

    rc, out = plan("--model", "deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--top", "1",
                   "--overlap-fb", "--json")
    assert rc == 0, out
    doc = json.loads(out)
    assert doc["gpu"] == "h800" and doc["global_batch"] == 15360
    assert doc["shape"]["attention"] == "mla" and doc["shape"]["dense_layers"] == 3
    best = doc["layouts"][0]
    assert best["fits"] and best["memory_total_bytes"] <= 80e9 and 0 < best["bubble_fraction"] < 1
    paper = [n for n in doc["explanation"] if n.startswith("Tokens/s per GPU")]
    ours = best["tokens_per_s"] / 2048
    assert len(paper) == 1 and f"{ours:,.0f}" in paper[0] and "1,543" in paper[0]
    assert any(n.startswith("Fit first") for n in doc["explanation"])
    # the best layout splits the sequence under a simulated DualPipeV pipeline; the
    # context-parallel line prices the layout's own mode at its row's step time, not by a
    # second estimate (a closed-form pipeline once gave 28.8 s beside the row's 23.8 s)
    assert best["layout"]["cp"] > 1 and best["layout"]["pp"] > 1
    (line,) = [n for n in doc["explanation"] if n.startswith("Context parallel mode")]
    ring = re.search(r"; ring: ([0-9.]+) s", line)
    assert ring and ring.group(1) == f"{best['step_time_s']:.3f}", line
