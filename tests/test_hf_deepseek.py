"""Hugging Face DeepSeek-V3-shaped models in and out (plait/checkpoint/hf_deepseek.py):
plait's logits equal `DeepseekV3ForCausalLM`'s, an imported model starts every layout at
transformers' loss, export round trips bit for bit, and the config plait writes loads as
the same model.

Nothing is downloaded: the model is a tiny random `DeepseekV3Config` (MLA with a query
latent, one dense layer then MoE with a shared expert, group-limited sigmoid routing,
routed scale 2.5, a random balancing bias) saved with `save_pretrained`. Weights are
drawn with std 0.1 so that attention is far from uniform. Tolerance: 1e-5 of the largest
logit, as tests/test_hf.py's (fp32, the same sums in another order).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import config, token_file
from test_hf import LOGIT_RTOL, _losses, rel_diff
from test_hf import plait_model as llama_plait_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from plait.checkpoint import hf_deepseek  # noqa: E402
from plait.checkpoint.format import CheckpointError  # noqa: E402
from plait.checkpoint.hf import HFWeights, model_config  # noqa: E402
from plait.checkpoint.interop import export  # noqa: E402
from plait.launch.forked import run_ranks  # noqa: E402
from plait.model.moe import MoE  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
             topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
             qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
             max_position_embeddings=64, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
             num_nextn_predict_layers=0)


def make_ds(path: Path, **extra) -> None:
    cfg = transformers.DeepseekV3Config(**{**SHAPE, **extra})
    torch.manual_seed(5)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
        for layer in model.model.layers[SHAPE["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ds") / "deepseek"
    make_ds(path)
    return path


def plait_model(path: Path):
    """test_hf's model read whole from the directory, and the MoE balancing biases."""
    model = llama_plait_model(path)
    weights = HFWeights(path, model_config(path))
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, MoE):
                m.bias.copy_(weights.full(f"{name}.bias"))
    return model.eval()


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(tokens).logits


def test_config_is_read_as_published(ds_dir):
    m = model_config(ds_dir)
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim,
            m.qk_rope_head_dim, m.v_head_dim) == ("mla", 32, 16, 16, 8, 16)
    assert (m.n_experts, m.top_k, m.n_dense_layers, m.route_groups, m.route_max_groups,
            m.routed_scale, m.router_score) == (8, 4, 1, 4, 2, 2.5, "sigmoid")
    config(*(f"model.{k}={v}" for k, v in dataclasses.asdict(m).items())).check(1)


def test_logits_equal_transformers(ds_dir):
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = plait_model(ds_dir)(tokens)
    theirs = hf_logits(ds_dir, tokens)
    assert rel_diff(ours, theirs) < LOGIT_RTOL


def test_the_balancing_bias_and_routed_scale_matter(ds_dir):
    """Negative controls: without the loaded bias, or with routed_scale 1, the logits
    move far beyond the tolerance (so the equality above checks both)."""
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    theirs = hf_logits(ds_dir, tokens)
    model = plait_model(ds_dir)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE):
                m.routed_scale = 1.0
        assert rel_diff(model(tokens), theirs) > 100 * LOGIT_RTOL
        model = plait_model(ds_dir)
        for m in model.modules():
            if isinstance(m, MoE):
                m.bias.zero_()
        assert rel_diff(model(tokens), theirs) > 100 * LOGIT_RTOL


def ds_sets(path: Path, *more: str) -> list[str]:
    model = model_config(path)
    return [*(f"model.{k}={v}" for k, v in dataclasses.asdict(model).items()),
            f"train.init_from=hf:{path}", "train.steps=1", *more]


def test_imported_into_layouts_starts_at_transformers_loss(ds_dir):
    """The single process's first loss is transformers' mean cross-entropy on the same
    rows; tp + SP (heads split, down-projections replicated), dp x ep with ZeRO-3 and
    pp x cp ring each read their slices (experts by rows) and start at it too."""
    sets = ds_sets(ds_dir)
    cfg = config(*sets)
    token_file()
    batches = GlobalBatches(TokenFile.open(token_file()), cfg.train.seq_len,
                            cfg.train.global_batch, cfg.train.seed, cfg.model.vocab_size)
    rows = batches.rows(0)
    logits = hf_logits(ds_dir, rows[:, :-1])
    theirs = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     rows[:, 1:].reshape(-1)))
    ours = _losses(0, 1, sets)[0]
    assert math.isclose(ours, theirs, rel_tol=LOGIT_RTOL), (ours, theirs)
    for layout in (("parallel.tp=2", "parallel.sp=true"),
                   ("parallel.dp=2", "parallel.ep=2", "parallel.zero=3"),
                   ("parallel.pp=2", "parallel.cp=2", "parallel.microbatches=2")):
        lay_sets = ds_sets(ds_dir, *layout)
        world = config(*lay_sets).parallel.world_size
        for losses in run_ranks(_losses, world, lay_sets):
            assert math.isclose(losses[0], ours, rel_tol=1e-5), (layout, losses, ours)


def test_export_round_trips_and_the_written_config_is_the_model(ds_dir, tmp_path):
    out, n = export(f"hf:{ds_dir}", f"hf:{tmp_path / 'out'}", "fp32")
    want = safetensors_torch.load_file(ds_dir / "model.safetensors")
    got = safetensors_torch.load_file(out / "model.safetensors")
    assert n == len(want) and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # plait's own config.json for the model (what an export of a plait checkpoint writes)
    fresh = tmp_path / "fresh"
    shutil.copytree(out, fresh)
    written = hf_deepseek.hf_config(model_config(ds_dir), "float32")
    (fresh / "config.json").write_text(json.dumps(written))
    assert model_config(fresh) == model_config(ds_dir)
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    assert rel_diff(hf_logits(fresh, tokens), hf_logits(ds_dir, tokens)) < LOGIT_RTOL


@pytest.mark.parametrize("extra, phrase", [
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 16}}, "rope_type='yarn'"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ({"num_experts_per_tok": 2}, "DeepSeek scores a group by its top 2"),
])
def test_unrepresentable_configs_are_refused(ds_dir, tmp_path, extra, phrase):
    bad = tmp_path / "bad"
    shutil.copytree(ds_dir, bad)
    c = json.loads((bad / "config.json").read_text())
    c.update(extra)
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError) as e:
        model_config(bad)
    assert phrase in str(e.value)
