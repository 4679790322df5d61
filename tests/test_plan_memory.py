"""Memory model: the ZeRO paper's numbers and Korthikanti et al.'s activation formulas."""

import numpy as np
import pytest

from plait.model.presets import PRESETS
from plait.plan.activations import RUNTIME_ATTENTION, layer_saved_bytes
from plait.plan.calibration import load_data, load_runs
from plait.plan.compute import Efficiency
from plait.plan.estimate import Layout, evaluate
from plait.plan.memory import inflight_chunks, layer_activations, model_states
from plait.plan.shape import activation_terms, from_model_config, from_preset, gpt_shape

GiB = 2**30
DATA = load_data()  # the packaged copy, plait/plan/data/
CONFIGS = DATA["tables"][0]["rows"]
EFF = Efficiency(0.8, 1e10, 0.5, 0.0)


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(stage, expected_gb):
    # Rajbhandari et al. 2020, section 5 / Figure 1: Psi = 7.5B, N_d = 64, K = 12
    total = sum(model_states(7.5e9, 64, stage, "bf16", "adam").values())
    assert round(total / 1e9, 1) == expected_gb


FORMULA_MODES = {  # JSON row -> (tp is t, sequence parallel, recompute)
    "no parallelism": (False, False, "none"),
    "tensor parallel (baseline)": (True, False, "none"),
    "tensor + sequence parallel": (True, True, "none"),
    "tensor parallel + selective recompute": (True, False, "selective"),
    "tensor + sequence parallel + selective recompute": (True, True, "selective"),
    "full recompute (store layer input only)": (False, False, "full"),
}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["model"] for c in CONFIGS])
@pytest.mark.parametrize("row", DATA["formulas_activation_memory_per_layer_bytes"]["rows"],
                         ids=lambda r: r["config"])
def test_korthikanti_per_layer_formulas(cfg, row):
    s, b, h, a, t = (cfg["seq_len"], cfg["microbatch_size"], cfg["hidden_size"],
                     cfg["attention_heads"], cfg["tp"])
    use_t, sp, rec = FORMULA_MODES[row["config"]]
    expected = eval(row["expr"], {}, {"s": s, "b": b, "h": h, "a": a, "t": t})
    shape = gpt_shape(cfg["num_layers"], h, a, s)
    got = layer_activations(shape, b, t if use_t else 1, 1, sp, rec, attention="math")
    assert float(got) == pytest.approx(expected, rel=1e-12)


FIG1 = {r["model"]: r for r in DATA["tables"][1]["rows"]}


@pytest.mark.parametrize("run", [r for r in load_runs() if "selective" in r.name],
                         ids=lambda r: r.name)
def test_korthikanti_figure1_memory(run):
    """Figure 1 (as Calculon encodes it): activations of the first stage with the
    schedule's in-flight micro-batches and interleaving penalty, and 18-byte model states
    of the stage's layers."""
    fig = FIG1[run.name.split(" ")[0]]
    lay = run.layout
    for rec, sp, key in (("selective", True, "activations_seq_plus_selective_GiB"),
                         ("none", False, "activations_no_recompute_GiB")):
        est = evaluate(run.shape, run.cluster, run.train,
                       Layout(**{**lay.__dict__, "recompute": rec, "sp": sp}), EFF,
                       simulate=True)
        assert float(est.memory["activations"]) / GiB == pytest.approx(fig[key], rel=1e-3)
    layers = run.shape.layers // lay.pp
    states = 18 * layers * run.shape.layer_params() / lay.tp
    assert states / GiB == pytest.approx(fig["params_grads_optimizer_GiB"], rel=2e-3)


FIG7 = {r["model"]: r for r in DATA["tables"][2]["rows"]}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["model"] for c in CONFIGS])
def test_korthikanti_figure7_relative(cfg):
    fig = FIG7[cfg["model"].split(" ")[0]]
    shape = gpt_shape(cfg["num_layers"], cfg["hidden_size"], cfg["attention_heads"],
                      cfg["seq_len"])
    t, b = cfg["tp"], cfg["microbatch_size"]
    base = layer_activations(shape, b, t, 1, False, "none", attention="math")
    for key, sp, rec in (("seq", True, "none"), ("sel", False, "selective"),
                         ("seqsel", True, "selective"), ("full", False, "full")):
        rel = 100 * float(layer_activations(shape, b, t, 1, sp, rec, attention="math") / base)
        # Calculon's encoded bars differ from the closed forms by <= 0.15 points
        assert rel == pytest.approx(fig[key], abs=0.2)


def test_llama_block_coefficients():
    """Our block (no dropout, SwiGLU, GQA), flash attention, nothing recomputed: per token
    2*(4h + (h + 2kv + h + 3f)/t) bytes with SP off, plus the fp32 log-sum-exp 4a/t; the
    math kernel's selective (Korthikanti's: the probabilities dropped) keeps the same
    without the log-sum-exp; full keeps the layer input."""
    sh = from_preset("llama3-8b")
    h, kv, f, a, s = sh.hidden, sh.kv_dim, sh.ffn, sh.heads, sh.seq
    for t in (1, 2, 8):
        per_tok = 2 * (4 * h + (2 * h + 2 * kv + 3 * f) / t)
        assert float(layer_activations(sh, 1, t, 1, False, "none")) == s * (per_tok + 4 * a / t)
        assert float(layer_activations(sh, 1, t, 1, False, "selective", attention="math")) \
            == s * per_tok
        assert float(layer_activations(sh, 1, t, 1, True, "full")) == s * 2 * h / t
    # context parallelism splits the tokens
    assert float(layer_activations(sh, 1, 1, 4, False, "none")) == s * (
        2 * (6 * h + 2 * kv + 3 * f) + 4 * a) / 4


LLAMA_NAMES = ["attn norm input", "qkv input (norm out)", "q, k after RoPE", "v",
               "attention output", "mlp norm input", "mlp input (norm out)",
               "gate, up, product"]


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b"])
@pytest.mark.parametrize("t,sp", [(1, False), (8, False), (8, True)])
def test_flash_none_is_the_saved_list_without_scores(name, t, sp):
    """`none` + flash: exactly the block's saved tensors with no probabilities, plus the
    kernel's fp32 log-sum-exp per head (Dao et al. 2022, sec. 3.1), written out here per
    token from plait's block, not from the planner's list."""
    sh = from_preset(name)
    h, kv, f, a, s, b = sh.hidden, sh.kv_dim, sh.ffn, sh.heads, sh.seq, 2
    terms = activation_terms(sh, 2, attention="flash")
    assert not any(term.scores for term in terms)
    assert [term.name for term in terms] == LLAMA_NAMES[:4] + ["log-sum-exp (fp32)"] \
        + LLAMA_NAMES[4:]
    norms = 2 * 4 * h / (t if sp else 1)  # two norms' inputs and outputs
    split = 2 * (h + kv + kv + h + 3 * f) / t  # q, k; v; the output; gate, up, product
    want = b * s * (norms + split + 4 * a / t)
    assert float(layer_activations(sh, b, t, 1, sp, "none")) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("t,sp,cp", [(1, False, 1), (8, True, 1), (4, True, 2)])
def test_math_adds_the_probabilities(t, sp, cp):
    """The math kernel keeps the softmax probabilities, a*s bf16 values per token (its
    queries against all s keys, also under cp), instead of flash's fp32 log-sum-exp (4a
    bytes): math - flash = (2as - 4a)/t bytes per token of a layer."""
    sh = from_preset("llama3-70b")
    a, s, b = sh.heads, sh.seq, 1
    flash = layer_activations(sh, b, t, cp, sp, "none")
    math = layer_activations(sh, b, t, cp, sp, "none", attention="math")
    tokens = b * s / cp
    assert float(math - flash) == pytest.approx(tokens * (2 * a * s - 4 * a) / t, rel=1e-12)
    # Korthikanti's selective (math) drops exactly them again; full is kernel-independent
    sel = layer_activations(sh, b, t, cp, sp, "selective", attention="math")
    assert float(math - sel) == pytest.approx(tokens * 2 * a * s / t, rel=1e-12)
    assert float(layer_activations(sh, b, t, cp, sp, "full", attention="math")) == float(
        layer_activations(sh, b, t, cp, sp, "full"))


def _tp_splits_heads(name: str, t: int) -> bool:
    cfg = PRESETS[name]
    return not cfg.n_heads % t and not (cfg.n_kv_heads % t and t % cfg.n_kv_heads)


# the tp degrees that split each preset's heads (tp=8 needs 8 query heads)
FLASH_CASES = [(name, t, sp) for name in ("tiny", "tiny-gqa", "llama3-70b")
               for t, sp in ((1, False), (2, False), (2, True), (8, True))
               if _tp_splits_heads(name, t)]


@pytest.mark.parametrize("name, t, sp", FLASH_CASES)
@pytest.mark.parametrize("ops", [("attention", "elementwise"), ("elementwise",),
                                 ("matmul", "elementwise")])
def test_flash_selective_is_the_runtimes_list(name, t, sp, ops):
    """Selective with flash is plait's operator policy: the bytes the runtime keeps
    (`layer_saved_bytes`, measured to the byte in tests/test_recompute.py), in bf16."""
    cfg = PRESETS[name]
    sh, b = from_model_config(cfg, 64), 2
    want = layer_saved_bytes(cfg, b, 64, t, sp, 2, "selective", ops)
    got = layer_activations(sh, b, t, 1, sp, "selective", ops=ops)
    assert float(got) == want


def test_cpu_sdpa_keeps_the_flash_tensors():
    """RUNTIME_ATTENTION: plait's attention core on CPU saves q, k, v, the output and an fp32
    log-sum-exp per head and query, no s x s tensor, with GQA too (torch's CPU flash kernel)."""
    import torch

    from plait.model.rope import Positions
    from plait.model.transformer import CausalAttentionCore

    b, a, kv, s, d = 2, 4, 2, 32, 8
    saved = []
    q = torch.randn(b, a, s, d, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, requires_grad=True) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        CausalAttentionCore()(q, k, v, Positions(None, torch.ones(s, d // 2),
                                                 torch.zeros(s, d // 2)))
    assert RUNTIME_ATTENTION == "flash"
    assert sorted(tuple(x.shape) for x in saved) == sorted(
        [(b, a, s, d), (b, kv, s, d), (b, kv, s, d), (b, a, s, d), (b, a, s)])
    assert [x.dtype for x in saved if x.dim() == 3] == [torch.float32]


def test_inflight_closed_forms():
    assert inflight_chunks("1f1b", 8, 64, 1)[0] == 8
    # interleaving penalty 1 + (p-1)/(pv), in chunks of L/(pv) layers
    p, v = 8, 3
    assert inflight_chunks("interleaved", p, 64, v)[0] / (p * v) == pytest.approx(
        1 + (p - 1) / (p * v))
    assert inflight_chunks("gpipe", 4, 16, 1)[0] == 16
    assert inflight_chunks("dualpipe", 8, 64, 1)[0] == 9


def test_moe_experts_sharded_by_ep():
    sh = from_preset("mixtral-8x7b", seq=4096)
    from plait.plan.estimate import Training
    from plait.plan.hardware import Cluster, get_gpu
    cl, tr = Cluster(get_gpu("h100-sxm"), 64), Training(64)
    one = evaluate(sh, cl, tr, Layout(tp=8, dp=8, ep=1, zero=0), EFF)
    eight = evaluate(sh, cl, tr, Layout(tp=8, dp=8, ep=8, zero=0), EFF)
    # bf16 parameters; plait replicates MoE blocks over tp, so tp=8 does not divide them
    expert = sh.layers * sh.expert_params() * 2
    assert float(one.memory["parameters"] - eight.memory["parameters"]) == pytest.approx(
        expert * (1 - 1 / 8))
    assert any(c.dim == "ep" for c in eight.collectives)
    assert not any(c.dim == "ep" for c in one.collectives)
    assert np.isfinite(float(eight.step_time))


@pytest.mark.parametrize("precision,optimizer,copy", [("bf16", "adam", 12), ("fp32", "adam", 12),
                                                      ("bf16", "sgd", 4)])
def test_post_validation_holds_a_copy_of_the_optimizer_states(precision, optimizer, copy):
    """The copy plait/parallel/post_validation.py takes before its optimistic update
    (masters, cloned even where the fp32 parameter is its own master, and Adam's moments),
    over the optimizer's shard; in "optimizer states", and in the planner's estimate."""
    for zero, shard in ((0, 1), (1, 4)):
        barrier = model_states(1000, 4, zero, precision, optimizer)
        post = model_states(1000, 4, zero, precision, optimizer, "post_validation")
        assert post["optimizer states"] - barrier["optimizer states"] == 1000 * copy / shard
        assert {k: v for k, v in post.items() if k != "optimizer states"} == \
            {k: v for k, v in barrier.items() if k != "optimizer states"}
    from plait.plan.estimate import Training
    from plait.plan.hardware import Cluster, get_gpu
    sh, cl = from_preset("llama3-8b", seq=4096), Cluster(get_gpu("h100-sxm"), 8)
    lay = Layout(pp=2, dp=4, zero=1)
    est = {s: evaluate(sh, cl, Training(32, optimizer_sync=s), lay, EFF).memory
           for s in ("barrier", "post_validation")}
    extra = float(est["post_validation"]["optimizer states"] - est["barrier"]["optimizer states"])
    assert extra / float(est["barrier"]["optimizer states"]) == pytest.approx(1.0)  # 12 vs 12
