"""The planner's block shapes and FLOP counts against the published definitions.

- Megatron-LM (Narayanan et al. 2021, section 5.1, eq. 3): a GPT iteration with full
  recompute costs F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (4 passes over the layers,
  3 over the logits); without recompute the same counting gives 72 B s l h^2
  (1 + s/(6h) + V/(12 l h)); its parameter count is 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))
  (tied head, learned positions).
- PaLM (Chowdhery et al. 2022, appendix B): model FLOPs per token 6N + 12 L H Q T, with N
  here the parameters that take part in a matmul per token (every weight matrix and the LM
  head; norms, biases and the embedding lookup cost no matmul).

Exact (rel 1e-12): the planner and the closed forms count the same products, only the
summation order differs.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import plan_cli as plan

from plait.model.presets import PRESETS
from plait.model.recompute import Recompute, extra_forward_flops_per_token
from plait.model.recompute_settings import DEFAULT_OPS
from plait.plan.calibration import EFFICIENCY
from plait.plan.compute import model_flops_per_token, recomputed_flops_per_token
from plait.plan.estimate import Layout, Training, evaluate
from plait.plan.hardware import GPUS, Cluster
from plait.plan.shape import Shape, from_model_config, gpt_shape

REL = 1e-12




def step_flops(shape: Shape, batch: int, recompute: str, attention: str = "math"
               ) -> tuple[float, float]:
    """Model and hardware FLOPs of a step (the GPT runs' math kernel by default)."""
    est = evaluate(shape, Cluster(GPUS["a100-80gb"], 64), Training(batch),
                   Layout(tp=8, pp=8, dp=1, mbs=1, recompute=recompute, attention=attention),
                   EFFICIENCY)
    return float(est.extra["model_flops"]), float(est.extra["hardware_flops"])


@pytest.mark.parametrize("l,h,a,s,V", [(96, 12288, 96, 2048, 51200),  # GPT-3 175B
                                       (105, 20480, 128, 2048, 51200),  # 530B
                                       (4, 256, 4, 128, 1000)])
def test_megatron_eq3(l, h, a, s, V):
    shape, B = gpt_shape(l, h, a, s, V), 64
    model, hw_full = step_flops(shape, B, "full")
    assert hw_full == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)),
                                    rel=REL)
    assert model == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)),
                                  rel=REL)
    none = step_flops(shape, B, "none")
    assert none == (model, model)  # without recompute hardware FLOPs are model FLOPs
    _, hw_sel = step_flops(shape, B, "selective")  # the attention core forward again
    assert hw_sel == pytest.approx(model + 4 * B * s * s * h * l, rel=REL)


def test_megatron_parameter_count():
    for l, h, s, V in [(96, 12288, 2048, 51200), (3, 64, 16, 100)]:
        shape = replace(gpt_shape(l, h, h // 64 or 1, s, V), tie_embeddings=True)
        # Narayanan et al. learn s x h positions; plait's blocks have none but a final
        # LayerNorm (2h) the formula leaves out
        got = shape.num_params() + s * h - 2 * h
        assert got == pytest.approx(12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h)),
                                    rel=REL)


def _palm(shape: Shape, matmul_params: int, causal: float) -> float:
    L, H, Q, T = shape.layers, shape.heads, shape.head_dim, shape.seq
    return 6 * matmul_params + causal * 12 * L * H * Q * T


def test_palm_gpt_block_any_ffn_and_gqa():
    shape = Shape(layers=6, hidden=512, heads=8, kv_heads=2, ffn=1536, vocab=3000, seq=256,
                  arch="gpt")
    h, kv, f = 512, 2 * 64, 1536
    n = 6 * (2 * h * h + 2 * h * kv + 2 * h * f) + 3000 * h
    assert model_flops_per_token(shape) == pytest.approx(_palm(shape, n, 1.0), rel=REL)


def test_palm_llama_block_causal_half():
    cfg = PRESETS["llama3-8b"]
    shape = from_model_config(cfg, 8192)
    h, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    n = cfg.n_layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_dim) + cfg.vocab_size * h
    assert model_flops_per_token(shape) == pytest.approx(_palm(shape, n, 0.5), rel=REL)


# leading dense layers are an MoE field: a dense preset takes 0 only
COUNT_CASES = [(name, dense) for name in ("tiny", "tiny-gqa", "llama3-70b", "mixtral-8x7b",
                                          "tiny-moe", "deepseek-v3")
               for dense in ((0, 1, 3) if PRESETS[name].n_experts else (0,))]


@pytest.mark.parametrize("name, dense", COUNT_CASES)
def test_planner_counts_equal_the_runtime_model(name, dense):
    """Parameters and FLOPs of the planner's shape equal ModelConfig's (the numbers a run's
    summary reports), MoE leading dense layers included."""
    cfg = replace(PRESETS[name], n_dense_layers=dense)
    shape = from_model_config(cfg, 512)
    assert shape.num_params() == cfg.num_params()
    assert model_flops_per_token(shape) == pytest.approx(cfg.flops_per_token(512), rel=REL)


RUNTIME_OPS = [("attention", "elementwise"), ("elementwise",), ("matmul", "elementwise")]


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa", "llama3-8b", "llama3-70b"])
@pytest.mark.parametrize("mode,ops", [("selective", o) for o in RUNTIME_OPS] + [("full", ())])
def test_recomputed_flops_are_the_runtimes_list(name, mode, ops):
    """With flash attention the planner's recompute costs exactly the forward FLOPs of what
    the runtime's policy recomputes (plait/model/recompute.py's count, whole-B schedules);
    the math kernel computes the full masked matrix, so it adds the other causal half."""
    cfg, s = PRESETS[name], 1024
    shape = from_model_config(cfg, s)
    rec = Recompute.of(mode, ops or DEFAULT_OPS)
    want = extra_forward_flops_per_token(cfg, s, rec)
    ops = ops or DEFAULT_OPS
    assert recomputed_flops_per_token(shape, mode, "flash", ops) == pytest.approx(want, rel=REL)
    assert recomputed_flops_per_token(shape, "none", "flash", ops) == 0.0
    core_half = cfg.n_layers * 2 * s * cfg.dim  # causal: 4 s h / 2 per token and layer
    if mode == "full":
        assert recomputed_flops_per_token(shape, mode, "math") == pytest.approx(
            want + core_half, rel=REL)
    else:  # Korthikanti's selective: the (full) attention core only
        assert recomputed_flops_per_token(shape, mode, "math") == pytest.approx(
            2 * core_half, rel=REL)
    # hardware FLOPs per step: the model FLOPs (the llama block's causal convention) + the
    # recomputation, both kernels; math executes the masked half three times more
    B = 8
    model, hw = step_flops(shape, B, mode, "flash")
    assert hw == pytest.approx(model + B * s * recomputed_flops_per_token(
        shape, mode, "flash"), rel=REL)
    _, hw_math = step_flops(shape, B, "none", "math")
    assert hw_math == pytest.approx(model + 3 * B * s * core_half, rel=REL)


def test_dense_layers_on_the_first_stage():
    base = ("--model", "deepseek-v3", "--gpus", "2048", "--global-batch", "4096",
            "--layout", "tp=8,pp=16,dp=16,ep=16", "--zero", "1", "--json")
    got = {}
    for dense in ("0", "3"):
        rc, out = plan(*base, "--dense-layers", dense, "--schedule", "1f1b")
        assert rc == 0, out
        got[dense] = json.loads(out)
    s0, s3 = (from_model_config(replace(PRESETS["deepseek-v3"], n_dense_layers=n))
              for n in (0, 3))
    assert got["3"]["params"] == s3.num_params() < got["0"]["params"] == s0.num_params()
    assert got["3"]["shape"]["dense_layers"] == 3
    f0, f3 = (got[k]["layouts"][0]["flops_per_step"]["model"] for k in ("0", "3"))
    assert f3 / f0 == pytest.approx(model_flops_per_token(s3) / model_flops_per_token(s0))


def test_arch_gpt_is_planned_and_said_untrainable():
    rc, out = plan("--arch", "gpt", "--layers", "24", "--hidden", "2048", "--heads", "16",
                   "--vocab", "51200", "--seq", "2048", "--gpus", "8", "--global-batch", "64",
                   "--layout", "tp=2,pp=1,dp=4", "--json")
    assert rc == 0, out
    doc = json.loads(out)
    assert doc["shape"]["arch"] == "gpt" and doc["shape"]["ffn"] == 4 * 2048
    assert doc["shape"]["trainable_by_plait"] is False
    assert any("does not build" in line for line in doc["explanation"])
    assert set(doc["flop_definitions"]) == {"model", "hardware"}
    rc, text = plan("--model", "gpt3-1.3b", "--arch", "gpt", "--gpus", "8", "--global-batch",
                    "64", "--layout", "tp=1,pp=1,dp=8", "--recompute", "full")
    assert rc == 0 and "FLOPs per step: model" in text and "does not build" in text


def test_preset_fields_replaced_by_flags():
    rc, out = plan("--model", "llama3-8b", "--layers", "4", "--kv-heads", "32", "--ffn", "1024",
                   "--gpus", "8", "--global-batch", "8", "--layout", "tp=8", "--json")
    assert rc == 0, out
    doc = json.loads(out)
    want = from_model_config(replace(PRESETS["llama3-8b"], n_layers=4, n_kv_heads=32,
                                     ffn_dim=1024))
    assert doc["params"] == want.num_params() and doc["model"] == "llama3-8b (modified)"


@pytest.mark.parametrize("argv,phrase", [
    (("--model", "tiny", "--arch", "gpt", "--experts", "4", "--top-k", "2", "--expert-ffn",
      "32"), "MoE is modelled in the llama block only"),
    (("--model", "tiny", "--dense-layers", "1"), "--dense-layers is for an MoE model"),
    (("--model", "tiny-moe", "--dense-layers", "2"), "must be < --layers 2"),
    (("--model", "tiny-moe", "--top-k", "9"), "more than the 8 experts"),
])
def test_bad_shapes_refused(argv, phrase):
    rc, out = plan(*argv, "--gpus", "8", "--global-batch", "8")
    assert rc == 2 and phrase in out, out
