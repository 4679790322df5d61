"""Hugging Face Llama models in: plait's logits equal `LlamaForCausalLM`'s, and
an imported model starts every layout from the same first loss.

Nothing is downloaded: each model is a tiny random `LlamaConfig` saved with
`save_pretrained` in a temporary directory. Weights are drawn with a larger std than
Hugging Face's default (0.02) so that attention is far from uniform: a RoPE convention
off by a permutation, or a missed frequency scaling, moves the logits by far more than
the tolerance (the negative controls below check that it does).

Tolerance: 1e-5 of the largest logit (fp32). Both models compute the same sums in fp32;
what differs is the order of reductions and the RoPE tables (plait's in float64 rounded
to fp32, Hugging Face's in fp32): measured 5.7e-7 to 7.9e-7.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from helpers import config, token_file

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from plait.checkpoint.hf import HFError, HFWeights, model_config  # noqa: E402
from plait.launch.forked import run_ranks  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.model.transformer import build_model  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile  # noqa: E402
from plait.train.loop import train  # noqa: E402

LOGIT_RTOL = 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def make_hf(path: Path, kv_heads: int = 4, tied: bool = False, rope: dict | None = None,
            vocab: int = 256, layers: int = 2, std: float = 0.1, shard: str | None = None,
            **extra):
    """A random LlamaForCausalLM saved in `path`; returns the model (eval mode)."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=88, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        tie_word_embeddings=tied, rope_parameters=rope, rms_norm_eps=1e-5, **extra)
    torch.manual_seed(hash((kv_heads, tied, rope is None)) % 1000)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, std)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


def plait_model(path: Path, permute: bool = True):
    """plait's model with every parameter read whole from the HF directory."""
    cfg = model_config(path)
    model = build_model(cfg, seed=0)
    weights = HFWeights(path, cfg)
    weights.check()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if permute:
                p.copy_(weights.full(name))
            else:  # the negative control: Hugging Face's row order as is
                hf_name = weights.names.get(name, weights.names["embed.weight"])[0]
                p.copy_(weights._slice(hf_name)[:].float())
    return model


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


CASES = {"mha-untied": dict(kv_heads=4), "mha-tied": dict(kv_heads=4, tied=True),
         "gqa-untied-llama3": dict(kv_heads=2, rope=LLAMA3_ROPE),
         "gqa-tied-llama3": dict(kv_heads=2, tied=True, rope=LLAMA3_ROPE),
         # shards listed in model.safetensors.index.json
         "gqa-sharded": dict(kv_heads=2, shard="40KB")}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(case, tmp_path):
    hf = make_hf(tmp_path / case, **CASES[case])
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = plait_model(tmp_path / case)(tokens)
        unpermuted = plait_model(tmp_path / case, permute=False)(tokens)
    err = rel_diff(got, want)
    print(f"{case}: max |logit diff| / max |logit| = {err:.2e}")
    if "shard" in CASES[case]:
        assert (tmp_path / case / "model.safetensors.index.json").is_file()
    assert err <= LOGIT_RTOL, err
    assert rel_diff(unpermuted, want) > 100 * LOGIT_RTOL  # the permutation matters


def test_mistral_without_a_window_is_read(tmp_path):
    cfg = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=88,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=None, rms_norm_eps=1e-5)
    torch.manual_seed(3)
    hf = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = rel_diff(plait_model(tmp_path)(tokens), hf(tokens).logits)
    assert err <= LOGIT_RTOL, err


def test_llama3_scaling_matters(tmp_path):
    """The same weights read as unscaled RoPE give other logits: the scaling is applied."""
    hf = make_hf(tmp_path / "m", kv_heads=2, rope=LLAMA3_ROPE)
    model = plait_model(tmp_path / "m")
    tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(2))
    from plait.model.rope import RotaryEmbedding

    cfg = model.cfg
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_seq_len)
    with torch.no_grad():
        assert rel_diff(model(tokens), hf(tokens).logits) > 100 * LOGIT_RTOL


@pytest.mark.parametrize("extra, phrase", [
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(mlp_bias=True), "mlp_bias=true"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(head_dim=8), "head_dim=8"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type='linear'"),
])
def test_unrepresentable_configs_are_refused(extra, phrase, tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40,
                                   num_hidden_layers=1, num_attention_heads=2, **extra)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(HFError, match=phrase.replace("(", r"\(").replace("[", r"\[")):
        model_config(tmp_path)


def test_other_families_are_refused(tmp_path):
    transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=40,
                             num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(HFError, match="q/k/v projection biases"):
        model_config(tmp_path)
    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(HFError, match="'gpt2' is not a Llama-family model"):
        model_config(tmp_path)


# ---- into any layout: the first loss --------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """An untied GQA Llama with Llama 3 RoPE scaling over the tests' 256-token data."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    make_hf(path, kv_heads=2, rope=LLAMA3_ROPE, std=0.05)
    return path


def hf_sets(path: Path, *more: str) -> list[str]:
    model = model_config(path)
    return [*(f"model.{k}={v}" for k, v in dataclasses.asdict(model).items()),
            f"train.init_from=hf:{path}", "train.steps=1", *more]


def _losses(rank: int, world: int, sets: list[str]) -> list[float]:
    cfg = config(*sets).check(world)
    batches = GlobalBatches(TokenFile.open(token_file()), cfg.train.seq_len,
                            cfg.train.global_batch, cfg.train.seed, cfg.model.vocab_size)
    return train(cfg, ParallelMesh.build(cfg.parallel), batches).losses


def _first_loss(rank: int, world: int, sets: list[str]) -> float:
    return _losses(rank, world, sets)[0]


def hf_loss(path: Path, tokens: torch.Tensor) -> float:
    """transformers' mean next-token cross-entropy on (rows, seq+1) tokens."""
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   tokens[:, 1:].reshape(-1)))


def test_single_process_first_loss_is_transformers(hf_dir):
    sets = hf_sets(hf_dir)
    cfg = config(*sets)
    batches = GlobalBatches(TokenFile.open(token_file()), cfg.train.seq_len,
                            cfg.train.global_batch, cfg.train.seed, cfg.model.vocab_size)
    ours = _first_loss(0, 1, sets)
    theirs = hf_loss(hf_dir, batches.rows(0))
    assert math.isclose(ours, theirs, rel_tol=LOGIT_RTOL), (ours, theirs)


@pytest.fixture(scope="module")
def hf_two_losses(hf_dir) -> list[float]:
    """The imported model's first two losses on one process, once for every layout."""
    return _losses(0, 1, hf_sets(hf_dir, "train.steps=2"))


@pytest.mark.parametrize("layout", [("parallel.tp=2",), ("parallel.pp=2",),
                                    ("parallel.dp=2", "parallel.zero=3"),
                                    ("parallel.dp=2", "parallel.zero=1"),
                                    ("parallel.tp=4",),  # 2 KV heads held by 2 ranks each
                                    ("parallel.tp=2", "parallel.pp=2")])
def test_imported_into_a_layout_starts_at_the_same_loss(hf_dir, hf_two_losses, layout):
    """Each rank reads only its slices (tp rows or columns, pp layers, ZeRO flat runs);
    the first loss is the single process's (fp32 parity tolerance, docs/parity.md), and
    so is the second: the fp32 masters were loaded too, not only the compute copies."""
    sets = hf_sets(hf_dir, "train.steps=2", *layout)
    token_file()
    ref = hf_two_losses
    world = config(*sets).parallel.world_size
    runs = run_ranks(_losses, world, sets)
    assert all(math.isclose(x, r, rel_tol=1e-5) for losses in runs
               for x, r in zip(losses, ref, strict=True)), (runs, ref)


def test_shapes_that_disagree_with_the_config_are_refused(hf_dir, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    c = json.loads((bad / "config.json").read_text())
    c["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(HFError, match=r"mlp.gate_proj.weight is \[88, 64\] in the files"):
        HFWeights(bad, model_config(bad)).check()


def _elements_read(rank: int, world: int, sets: list[str]) -> dict:
    """This rank's load, counting every element fetched from the safetensors files."""
    from plait.checkpoint import hf
    from plait.checkpoint.pieces import pieces
    from plait.parallel.parallelize import parallelize

    fetched = [0]

    class Counting:
        def __init__(self, sl):
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, index):
            t = self.sl[index]
            fetched[0] += t.numel()
            return t

    original = hf.HFWeights._slice
    hf.HFWeights._slice = lambda self, name: Counting(original(self, name))
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    par = parallelize(build_model(cfg.model, seed=0, device="meta"), mesh, cfg)
    hf.load_into(par, mesh, cfg, hf.hf_dir(cfg.train.init_from))
    held = sum(p.stop - p.start for p in pieces(par, mesh, "adamw") if p.state == "master")
    return {"fetched": fetched[0], "held": held}


@pytest.mark.parametrize("layout", [("parallel.tp=2", "parallel.pp=2"),
                                    ("parallel.dp=2", "parallel.zero=3")])
def test_each_rank_reads_only_its_slices(hf_dir, layout):
    """What a rank fetches from the files is what it holds (tp x pp: exactly; ZeRO-3: the
    rows covering its flat run), a fraction of the model: never the whole of it."""
    sets = hf_sets(hf_dir, *layout)
    total = model_config(hf_dir).num_params()
    world = config(*sets).parallel.world_size
    for r in run_ranks(_elements_read, world, sets):
        assert r["held"] <= r["fetched"] <= r["held"] + 2 * 256 * 64, r
        assert r["fetched"] < 0.75 * total, (r, total)
        if "parallel.tp=2" in layout:
            assert r["fetched"] == r["held"], r


def test_without_safetensors_the_error_names_the_package(hf_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails as if absent
    with pytest.raises(HFError, match="needs the safetensors package"):
        HFWeights(hf_dir, model_config(hf_dir))
