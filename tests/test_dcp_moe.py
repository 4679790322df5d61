"""DeepSeek-V3 / MoE checkpoints through DCP with torchtitan's names (plait/checkpoint/
titan_names.py), against a model with torchtitan's DeepSeek-V3 module structure: MLA with
a query latent, a dense first layer, then MoE, its routed experts stacked one parameter a
weight under `moe.routed_experts.inner_experts` (E x F x D, E x D x F), the router's
gate, a shared expert and the balancing bias `expert_bias_E`. Sharded by FSDP2 on 4 gloo
ranks and saved by DCP from the DTensors; plait reads it into other layouts (dp x ep x tp
with ZeRO-1, pp x cp) and starts at the single process's loss on the same weights, each
rank asking DCP for its own experts only; plait's export after a step loads into the
FSDP2 model bit for bit, and into torchtitan's 2025 structure with --dcp-names 2025.

The weights are drawn here (norms near one, the bias 0.1 a side, so routing depends on
it); fp32, so every tensor read or written is compared bit for bit, and the losses to
LOGIT_RTOL (tests/test_hf.py's bound: the same sums in another order)."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from helpers import batches_for, config, moe_biases, token_file
from test_dcp import fsdp2, full_params
from torch import nn

from plait.checkpoint import Checkpointing
from plait.checkpoint import dcp as plait_dcp
from plait.checkpoint.format import CheckpointError
from plait.checkpoint.interop import export
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.presets import PRESETS, ModelConfig
from plait.model.transformer import Transformer, build_model
from plait.parallel.parallelize import parallelize
from plait.train.loop import TrainOptions, full_state, train

M = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=96,
                max_seq_len=64, attention="mla", q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_experts=8, top_k=2,
                expert_ffn_dim=32, n_shared_experts=1, n_dense_layers=1,
                router_score="sigmoid", routed_scale=2.5, route_groups=4, route_max_groups=2,
                bias_update_rate=0.01)
LOGIT_RTOL = 1e-5
EP_LAYOUT = ("parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.zero=1")
PP_LAYOUT = ("parallel.pp=2", "parallel.cp=2", "parallel.microbatches=2")

# ---- torchtitan's names, written out here as the test's own oracle ---------------------------
# torchtitan/models/deepseek_v3 at b5bcd76 (2026-08-21); 2025: the names before its renames
SAME = {"embed.weight": "tok_embeddings.weight", "norm.weight": "norm.weight",
        "attn_norm.weight": "attention_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
        **{f"attn.{w}.weight": f"attention.{w}.weight"
           for w in ("wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo")},
        **{f"mlp.{w}.weight": f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")},
        "mlp.router.weight": "moe.router.gate.weight",
        **{f"mlp.shared.{w}.weight": f"moe.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}}
BY_NAMING = {  # attn.w{q,k,v}: grouped-query attention's (tiny-moe)
    "2026": {"head.weight": "lm_head.weight", "mlp.bias": "moe.expert_bias_E",
             **{f"attn.w{w}.weight": f"attention.qkv_linear.w{w}.weight" for w in "qkv"},
             "mlp.experts.w1": "moe.routed_experts.inner_experts.w1_EFD",
             "mlp.experts.w3": "moe.routed_experts.inner_experts.w3_EFD",
             "mlp.experts.w2": "moe.routed_experts.inner_experts.w2_EDF"},
    "2025": {"head.weight": "output.weight", "mlp.bias": "moe.expert_bias",
             **{f"attn.w{w}.weight": f"attention.w{w}.weight" for w in "qkv"},
             "mlp.experts.w1": "moe.experts.w1", "mlp.experts.w3": "moe.experts.w3",
             "mlp.experts.w2": "moe.experts.w2"},
}


def titan_key(ours: str, naming: str = "2026") -> str:
    """torchtitan's name of plait tensor `ours` (the test's table, not plait's)."""
    parts = ours.split(".")
    layer = ".".join(parts[:2]) + "." if parts[0] == "layers" else ""
    rest = ".".join(parts[2:]) if layer else ours
    return layer + {**SAME, **BY_NAMING[naming]}[rest]


def _holder(**children: nn.Module) -> nn.Module:
    module = nn.Module()
    for name, child in children.items():
        setattr(module, name, child)
    return module


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


def _moe(m: ModelConfig, naming: str) -> nn.Module:
    """torchtitan's MoE block: the stacked experts one parameter each, a shared expert."""
    d, e, f, fs = m.dim, m.n_experts, m.expert_ffn_dim, m.expert_ffn_dim * m.n_shared_experts
    moe = _holder(router=_holder(gate=_linear(d, e)),
                  shared_experts=_holder(w1=_linear(d, fs), w2=_linear(fs, d), w3=_linear(d, fs)))
    stack = nn.Module()
    for name, shape in zip(("w1", "w3", "w2"), ((e, f, d), (e, f, d), (e, d, f)), strict=True):
        suffix = {"w1": "_EFD", "w3": "_EFD", "w2": "_EDF"}[name] if naming == "2026" else ""
        setattr(stack, name + suffix, nn.Parameter(torch.empty(shape)))
    if naming == "2026":
        moe.routed_experts = _holder(inner_experts=stack)
    else:
        moe.experts = stack
    tag = "_E" if naming == "2026" else ""
    moe.register_buffer("expert_bias" + tag, torch.empty(e))
    moe.register_buffer("tokens_per_expert" + tag, torch.zeros(e), persistent=False)
    return moe


def titan_deepseek(m: ModelConfig, seed: int, naming: str = "2026") -> nn.Module:
    """A DeepSeek-V3 with torchtitan's module structure and names (no forward: plait's
    single process computes the reference loss from its weights)."""
    d, heads = m.dim, m.n_heads
    layers = nn.ModuleDict()
    for i in range(m.n_layers):
        attention = _holder(
            wq_a=_linear(d, m.q_lora_rank), q_norm=nn.RMSNorm(m.q_lora_rank),
            wq_b=_linear(m.q_lora_rank, heads * m.qk_head_dim),
            wkv_a=_linear(d, m.kv_lora_rank + m.qk_rope_head_dim),
            kv_norm=nn.RMSNorm(m.kv_lora_rank),
            wkv_b=_linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
            wo=_linear(heads * m.v_head_dim, d))
        block = _holder(attention_norm=nn.RMSNorm(d), attention=attention,
                        ffn_norm=nn.RMSNorm(d))
        if i < m.n_dense_layers:
            block.feed_forward = _holder(w1=_linear(d, m.ffn_dim), w2=_linear(m.ffn_dim, d),
                                         w3=_linear(d, m.ffn_dim))
        else:
            block.moe = _moe(m, naming)
        layers[str(i)] = block
    model = _holder(tok_embeddings=nn.Embedding(m.vocab_size, d), layers=layers,
                    norm=nn.RMSNorm(d))
    setattr(model, "lm_head" if naming == "2026" else "output", _linear(d, m.vocab_size))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            noise = torch.randn(t.shape, generator=gen)
            if "tokens_per_expert" not in name:
                t.copy_(1 + 0.1 * noise if "norm" in name
                        else 0.1 * noise if "expert_bias" in name else 0.05 * noise)
    return model


def model_sets(m: ModelConfig = M) -> list[str]:
    return [f"model.{k}={v}" for k, v in dataclasses.asdict(m).items() if v is not None]


def reference_loss(state: dict[str, torch.Tensor], sets: list[str]) -> float:
    """plait's single-process loss on the first batch with torchtitan's weights `state`."""
    cfg = config(*sets)
    model = Transformer(M)
    model.load_state_dict({ours: state[titan_key(ours)] for ours in model.state_dict()},
                          strict=False)  # the RoPE tables are not in the state dict
    batch = batches_for(cfg).rows(0)
    with torch.no_grad():
        logits = model(batch[:, :-1])
    return float(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))


# ---- the ranks ---------------------------------------------------------------------------------

def _save_titan(rank: int, world: int, root: Path) -> None:
    state = fsdp2(titan_deepseek(M, seed=1), world).state_dict()
    # the routing counter, where a checkpoint holds it beside the weights: plait skips it
    state["layers.1.moe.tokens_per_expert_E"] = torch.zeros(M.n_experts)
    dcp.save(state, checkpoint_id=root / "titan")


def _expert_rows(items) -> dict[str, set[int]]:
    """The global rows (experts) of each stacked expert weight DCP was asked to read."""
    rows: dict[str, set[int]] = {}
    for item in items:
        name = item.storage_index.fqn
        if "inner_experts" in name:
            lo = item.storage_index.offset[0] + item.storage_offsets[0]
            rows.setdefault(name, set()).update(range(lo, lo + item.lengths[0]))
    return rows


def _read_and_train(rank: int, world: int, root: Path, layout: tuple[str, ...]) -> dict:
    """Read torchtitan's checkpoint into `layout`; gather and compare; one step (the first
    loss); with ep, the step's checkpoint exported and loaded back into FSDP2."""
    sets = [*model_sets(), *layout, f"train.init_from=dcp:{root / 'titan'}",
            "train.steps=1", "train.precision=fp32"]
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    par = parallelize(build_model(cfg.model, seed=0, device="meta"), mesh, cfg)
    weights = plait_dcp.load_into(par, mesh, cfg, root / "titan")
    loaded = {**full_state(par.model, par.optimizer, mesh, par.placements),
              **moe_biases(par.model)}
    ref = full_params(titan_deepseek(M, seed=1))
    out = {"naming": weights.naming, "held": sorted(loaded),
           "differ": [n for n, t in loaded.items() if not torch.equal(t, ref[titan_key(n)])],
           "expert_rows": _expert_rows(weights.read_items),
           "ep": mesh.coord("ep") if cfg.parallel.ep > 1 else None}
    ck = Checkpointing(dir=root / f"ck-{cfg.parallel.ep}", final=True)
    result = train(cfg, mesh, batches_for(cfg), TrainOptions(checkpoint=ck))
    out["loss"] = result.losses[0]
    if cfg.parallel.ep == 1:
        return out
    trained = {**full_state(result.model, result.optimizer, mesh, result.placements),
               **moe_biases(result.model)}
    if rank == 0:
        export(str(ck.saved[-1]), f"dcp:{root / 'plait'}")
    dist.barrier()
    back = fsdp2(titan_deepseek(M, seed=2), world)
    try:
        dcp.load(back.state_dict(), checkpoint_id=root / "plait")
    except dcp.CheckpointException as e:  # every rank's plan fails alike: all return
        out["load_error"] = str(e).strip().splitlines()[-1]
        return out
    back_params = full_params(back)
    out["differ_out"] = [n for n, t in trained.items()
                         if not torch.equal(t, back_params[titan_key(n)])]
    out["moved"] = [n for n, t in trained.items() if not torch.equal(t, loaded[n])]
    return out


@pytest.fixture(scope="module")
def titan(tmp_path_factory) -> tuple[Path, float]:
    """torchtitan's DeepSeek-V3 saved by DCP from 4 FSDP2 ranks, and plait's single-process
    first loss on its weights."""
    root = tmp_path_factory.mktemp("dcp-moe")
    token_file()
    run_ranks(_save_titan, 4, root)
    return root, reference_loss(full_params(titan_deepseek(M, seed=1)), model_sets())


@pytest.fixture(scope="module")
def ep_runs(titan) -> list[dict]:
    root, _ = titan
    return run_ranks(_read_and_train, 4, root, EP_LAYOUT)


def test_fsdp2_deepseek_read_into_dp_ep_tp_zero1(titan, ep_runs):
    """Every tensor plait gathers (the stacked experts, MLA's, the balancing biases) is
    torchtitan's bit for bit, and the first loss is the single process's on its weights."""
    _, ref_loss = titan
    for r in ep_runs:
        assert r["naming"] == "2026", r
        assert r["differ"] == [], r["differ"]
        assert "layers.1.mlp.bias" in r["held"] and "layers.1.mlp.experts.w2" in r["held"]
        assert math.isclose(r["loss"], ref_loss, rel_tol=LOGIT_RTOL), (r["loss"], ref_loss)


def test_each_rank_reads_only_its_experts(ep_runs):
    """DCP's read requests (through plait's load planner) for the stacked experts cover
    exactly the rank's expert-parallel rows: 4 of the 8 experts, never the whole stack."""
    for r in ep_runs:
        mine = set(range(4 * r["ep"], 4 * r["ep"] + 4))
        stacks = {f"layers.1.moe.routed_experts.inner_experts.{w}"
                  for w in ("w1_EFD", "w3_EFD", "w2_EDF")}
        assert set(r["expert_rows"]) == stacks, r["expert_rows"]
        for name, rows in r["expert_rows"].items():
            assert rows == mine, (name, r["ep"], sorted(rows))


def test_plait_export_loads_into_fsdp2_deepseek(ep_runs):
    """After a step (every tensor moved, the bias by the balancing update), plait's export
    loads into torchtitan's FSDP2-sharded structure bit for bit."""
    for r in ep_runs:
        assert "load_error" not in r, r["load_error"]
        assert r["differ_out"] == [], r["differ_out"]
        assert "layers.1.mlp.bias" in r["moved"] and "layers.1.mlp.experts.w1" in r["moved"]


def test_fsdp2_deepseek_read_into_pp_cp(titan):
    """pp2 x cp2: each stage reads its layers (the MoE layer's experts whole) and the first
    loss is the single process's."""
    root, ref_loss = titan
    runs = run_ranks(_read_and_train, 4, root, PP_LAYOUT)
    held = set()
    for r in runs:
        assert r["differ"] == [], r["differ"]
        assert math.isclose(r["loss"], ref_loss, rel_tol=LOGIT_RTOL), (r["loss"], ref_loss)
        held.update(r["held"])
    assert held == set(plait_dcp.titan_names(M))


def test_the_export_in_either_naming_and_plait_eval_without_settings(titan, ep_runs, tmp_path,
                                                                     capsys):
    """plait's checkpoint exported with --dcp-names 2025 loads strictly into torchtitan's
    2025 structure (moe.experts.w1, moe.expert_bias, output) with the 2026 export's
    tensors; `plait eval --init-from dcp:` of either needs no model settings and gives the
    plait checkpoint's loss, saying which naming it read."""
    from plait.cli.main import main

    root, _ = titan
    ck = root / "ck-2"
    assert main(["export", "--from", str(ck), "--to", f"dcp:{tmp_path / 'old'}",
                 "--dcp-names", "2025"]) == 0
    state = titan_deepseek(M, seed=3, naming="2025").state_dict()
    with plait_dcp.quiet_dcp():
        dcp.load(state, checkpoint_id=tmp_path / "old", no_dist=True)
    today = plait_dcp.DCPWeights(root / "plait", M)
    for ours in plait_dcp.titan_names(M):
        assert torch.equal(state[titan_key(ours, "2025")], today.full(ours)), ours
    losses = {}
    for name, source in (("ck", str(ck)), ("2026", f"dcp:{root / 'plait'}"),
                         ("2025", f"dcp:{tmp_path / 'old'}")):
        out = tmp_path / f"{name}.json"
        capsys.readouterr()
        code = main(["eval", "--init-from", source, "--data", str(token_file()), "--seq-len",
                     "32", "--eval-sequences", "8", "--global-batch", "8", "--metrics-out",
                     str(out)])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert captured.out.startswith("loss "), captured.out
        if name != "ck":
            assert f"torchtitan's {name} names" in captured.err, captured.err
        losses[name] = json.loads(out.read_text())["loss"]
    for name in ("2026", "2025"):
        assert math.isclose(losses[name], losses["ck"], rel_tol=LOGIT_RTOL), losses


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-mla", "deepseek-v3"])
def test_the_name_table_names_every_tensor_of_the_model(preset):
    """Every parameter and balancing bias of plait's model (built on the meta device) has
    torchtitan's name in each naming (the test's table) and plait's shape."""
    m = PRESETS[preset]
    with torch.device("meta"):
        model = Transformer(m)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for naming in ("2026", "2025"):
        table = plait_dcp.titan_names(m, naming)
        assert {n: s for n, (_, s) in table.items()} == shapes, naming
        assert all(theirs == titan_key(n, naming) for n, (theirs, _) in table.items())


def test_a_gqa_moe_model_round_trips_in_both_namings(tmp_path):
    """tiny-moe (grouped-query attention, MoE in every layer): a DCP checkpoint in
    torchtitan's names is read bit for bit, and plait's export of it in either naming
    holds exactly that naming's tensors, read back bit for bit."""
    m = dataclasses.replace(PRESETS["tiny-moe"], vocab_size=256, max_seq_len=64)
    state = build_model(m, seed=4).state_dict()
    gen = torch.Generator().manual_seed(5)
    for i in range(m.n_layers):  # a bias that is not the init's zeros
        state[f"layers.{i}.mlp.bias"] = torch.randn(m.n_experts, generator=gen)
    with plait_dcp.quiet_dcp():
        dcp.save({titan_key(n): t for n, t in state.items()}, checkpoint_id=tmp_path / "in",
                 no_dist=True)
    plait_dcp.write_record(tmp_path / "in", m)  # the model, as plait's export records it
    for source, naming in ((tmp_path / "in", "2026"),
                           *((export(f"dcp:{tmp_path / 'in'}", f"dcp:{tmp_path / n}",
                                     dcp_names=n)[0], n) for n in ("2026", "2025"))):
        keys = set(plait_dcp.read_metadata(source).state_dict_metadata)
        assert keys == {titan_key(n, naming) for n in state}, (source, naming)
        weights = plait_dcp.DCPWeights(source, m)
        weights.check()
        assert weights.naming == naming
        assert all(torch.equal(weights.full(n), state[n]) for n in state), source


def _metadata_only(directory: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A DCP directory whose `.metadata` describes tensors of `shapes`, bf16, one chunk
    each, and holds no data: what plait's preflight reads of a checkpoint."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    directory.mkdir()
    md = Metadata(state_dict_metadata={
        n: TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size(shape),
                                 [ChunkStorageMetadata(torch.Size([0] * len(shape)),
                                                       torch.Size(shape))])
        for n, shape in shapes.items()})
    (directory / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("naming", ["2026", "2025"])
def test_the_deepseek_v3_shape_is_read_by_its_metadata(tmp_path, naming):
    """A checkpoint of the published DeepSeek-V3 (61 layers, 256 experts; too big to fill
    here) in torchtitan's names: its naming found and every shape accepted from DCP's
    metadata; an expert stack in the other axis order is refused naming it."""
    m = PRESETS["deepseek-v3"]
    shapes = {titan_key(n, naming): shape for n, (_, shape) in
              plait_dcp.titan_names(m, naming).items()}
    _metadata_only(tmp_path / "ok", shapes)
    weights = plait_dcp.DCPWeights(tmp_path / "ok", m)
    assert weights.naming == naming
    weights.check()
    stack = titan_key("layers.3.mlp.experts.w1", naming)
    _metadata_only(tmp_path / "bad", {**shapes, stack: (256, 7168, 2048)})
    with pytest.raises(CheckpointError, match=re.escape(stack) + r" is \[256, 7168, 2048\] "
                       r"there, this run's model needs \[256, 2048, 7168\]"):
        plait_dcp.DCPWeights(tmp_path / "bad", m).check()
