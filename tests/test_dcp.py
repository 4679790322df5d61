"""torch.distributed.checkpoint (DCP) in and out, against the real thing: a Llama-shaped torch
model with torchtitan's module structure and names (today's: the `qkv_linear` submodule,
`lm_head`; and 2025's), sharded by FSDP2 (`fully_shard`) on gloo ranks, saved by DCP,
read by plait under another layout; plait's export read back by DCP into FSDP2, in
either naming. DeepSeek-V3 / MoE checkpoints: tests/test_dcp_moe.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from helpers import batches_for, config, token_file
from torch import nn

from plait.checkpoint import Checkpointing
from plait.checkpoint import dcp as plait_dcp
from plait.checkpoint.format import CheckpointError
from plait.checkpoint.init_from import check, describe_initial, initial_model
from plait.checkpoint.interop import export
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.presets import ModelConfig
from plait.model.transformer import Transformer, build_model
from plait.parallel.parallelize import parallelize
from plait.train.loop import TrainOptions, full_state, train

# GQA (2 KV heads of 4) so that the KV head order matters; untied, as torchtitan's Llama;
# ffn_dim 90: a tp2 rank's w1 has 45 rows, so ZeRO-3's halves of it end mid-row
MODEL = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=90,
                    max_seq_len=64, rope_theta=500000.0)
LOGIT_RTOL = 1e-5  # fp32, the largest logit's share (tests/test_hf.py's bound)
LAYOUT = ("parallel.dp=2", "parallel.zero=3", "parallel.tp=2")  # boxes and flat runs


# ---- a Llama with torchtitan's module structure ---------------------------------------------
# torchtitan/models/llama3 at b5bcd76 (2026-08-21): the projections in a `qkv_linear`
# submodule and the head `lm_head`; in 2025 the projections sat on the attention module and
# the head was `output`. Written out here, as the test's own oracle of the names.
TITAN_NAMES = {
    "2026": {"attn.wq.weight": "attention.qkv_linear.wq.weight",
             "attn.wk.weight": "attention.qkv_linear.wk.weight",
             "attn.wv.weight": "attention.qkv_linear.wv.weight", "head.weight": "lm_head.weight"},
    "2025": {"attn.wq.weight": "attention.wq.weight", "attn.wk.weight": "attention.wk.weight",
             "attn.wv.weight": "attention.wv.weight", "head.weight": "output.weight"},
}
SAME_NAMES = {"embed.weight": "tok_embeddings.weight", "norm.weight": "norm.weight",
              "attn_norm.weight": "attention_norm.weight", "attn.wo.weight": "attention.wo.weight",
              "mlp_norm.weight": "ffn_norm.weight", "mlp.w1.weight": "feed_forward.w1.weight",
              "mlp.w2.weight": "feed_forward.w2.weight", "mlp.w3.weight": "feed_forward.w3.weight"}


def titan_key(ours: str, naming: str = "2026") -> str:
    """torchtitan's name of plait parameter `ours` (the test's table, not plait's)."""
    layer, _, rest = ours.partition(".") if ours.startswith("layers.") else ("", "", ours)
    if layer:
        index, _, rest = rest.partition(".")
        layer = f"layers.{index}."
    return layer + {**SAME_NAMES, **TITAN_NAMES[naming]}[rest]


class QKVLinear(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.wq = nn.Linear(m.dim, m.n_heads * m.head_dim, bias=False)
        self.wk = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=False)
        self.wv = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=False)


class TitanAttention(nn.Module):
    def __init__(self, m: ModelConfig, naming: str):
        super().__init__()
        self.heads, self.kv, self.hd = m.n_heads, m.n_kv_heads, m.head_dim
        if naming == "2026":
            self.qkv_linear = QKVLinear(m)
        else:
            self.wq, self.wk, self.wv = QKVLinear(m).children()
        self.wo = nn.Linear(m.n_heads * m.head_dim, m.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        proj = getattr(self, "qkv_linear", self)
        q = proj.wq(x).view(b, s, self.heads, self.hd)
        k = proj.wk(x).view(b, s, self.kv, self.hd)
        v = proj.wv(x).view(b, s, self.kv, self.hd)

        def rotate(t):  # consecutive pairs as complex numbers, times e^(i pos f)
            c = torch.view_as_complex(t.float().reshape(b, s, t.shape[2], -1, 2))
            return torch.view_as_real(c * freqs_cis[:s, None, :]).flatten(3)

        q, k = rotate(q), rotate(k)
        rep = self.heads // self.kv  # query head j reads KV head j // rep
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, m: ModelConfig, naming: str):
        super().__init__()
        self.attention = TitanAttention(m, naming)
        self.feed_forward = TitanFeedForward(m.dim, m.ffn_dim)
        self.attention_norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        self.ffn_norm = nn.RMSNorm(m.dim, eps=m.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, m: ModelConfig, seed: int, naming: str = "2026"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(m.vocab_size, m.dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(m, naming) for i in range(m.n_layers)})
        self.norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        head = nn.Linear(m.dim, m.vocab_size, bias=False)
        self.head_name = "lm_head" if naming == "2026" else "output"
        setattr(self, self.head_name, head)
        freqs = 1.0 / m.rope_theta ** (torch.arange(0, m.head_dim, 2).float() / m.head_dim)
        angles = torch.outer(torch.arange(m.max_seq_len).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():  # norms near one, so they matter
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.freqs_cis)
        return getattr(self, self.head_name)(self.norm(h))


def fsdp2(model: TitanLlama, world: int) -> TitanLlama:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}


# ---- plait's side ----------------------------------------------------------------------------

def model_sets(m: ModelConfig = MODEL) -> list[str]:
    return [f"model.{k}={v}" for k, v in dataclasses.asdict(m).items() if v is not None]


def plait_logits(state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    model = Transformer(MODEL)
    model.load_state_dict(state, strict=False)  # the RoPE tables are buffers, not saved
    with torch.no_grad():
        return model(tokens)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _round_trip(rank: int, world: int, root: Path) -> dict:
    """torchtitan-shaped FSDP2 -> DCP -> plait (LAYOUT) -> one step -> plait checkpoint ->
    plait export dcp: -> DCP -> FSDP2, with what to compare at each end."""
    theirs = TitanLlama(MODEL, seed=1)
    # fp32: torchtitan's model and checkpoint, bit for bit both ways
    sets = [*model_sets(), *LAYOUT, f"train.init_from=dcp:{root / 'titan'}", "train.steps=1",
            "train.precision=fp32"]
    cfg = config(*sets).check(world)
    batch = batches_for(cfg).rows(0)
    tokens = batch[:, :-1]
    with torch.no_grad():
        ref_logits = theirs(tokens)
    ref_params = full_params(theirs)
    ref_loss = float(F.cross_entropy(ref_logits.flatten(0, 1), batch[:, 1:].flatten()))
    dcp.save(fsdp2(theirs, world).state_dict(), checkpoint_id=root / "titan")

    mesh = ParallelMesh.build(cfg.parallel)  # read into plait's layout, gather, compare
    par = parallelize(build_model(cfg.model, seed=0, device="meta"), mesh, cfg)
    weights = plait_dcp.load_into(par, mesh, cfg, root / "titan")
    loaded = full_state(par.model, par.optimizer, mesh, par.placements)
    out = {"requested": sum(math.prod(r.lengths) for r in weights.read_items),
           "naming": weights.naming,
           "bit_identical_in": all(torch.equal(t, ref_params[titan_key(n)])
                                   for n, t in loaded.items()),
           "logits_in": rel_diff(plait_logits(loaded, tokens), ref_logits)}

    ck = Checkpointing(dir=root / "ck", final=True)  # one step, then out through DCP
    result = train(cfg, mesh, batches_for(cfg), TrainOptions(checkpoint=ck))
    out["loss"], out["ref_loss"] = result.losses[0], ref_loss
    trained = full_state(result.model, result.optimizer, mesh, result.placements)
    if rank == 0:
        export(str(ck.saved[-1]), f"dcp:{root / 'plait'}")
    dist.barrier()
    back = fsdp2(TitanLlama(MODEL, seed=2), world)
    dcp.load(back.state_dict(), checkpoint_id=root / "plait")
    with torch.no_grad():
        back_logits = back(tokens)
    back_params = full_params(back)
    out["bit_identical_out"] = all(torch.equal(t, back_params[titan_key(n)])
                                   for n, t in trained.items())
    out["logits_out"] = rel_diff(back_logits, plait_logits(trained, tokens))
    out["trained_moved"] = float((trained["layers.0.attn.wq.weight"]
                                  - loaded["layers.0.attn.wq.weight"]).abs().max())
    return out


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("dcp")
    token_file()
    return run_ranks(_round_trip, 4, root), root


def test_fsdp2_checkpoint_read_by_plait_in_another_layout(round_trip):
    """DCP's files from 4 FSDP2 ranks (row shards) read by plait's dp2 ZeRO-3 x tp2 ranks:
    every gathered parameter is torchtitan's bit for bit, the logits and the first loss
    agree (fp32), and each rank asked DCP for its own slices, not the model."""
    runs, _ = round_trip
    total = MODEL.num_params()
    for r in runs:
        assert r["naming"] == "2026", r
        assert r["bit_identical_in"], r
        assert r["logits_in"] <= LOGIT_RTOL, r
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=LOGIT_RTOL), r
        assert r["requested"] < 0.6 * total, (r, total)


def test_plait_export_read_by_dcp_into_fsdp2(round_trip):
    """plait's export after a step, loaded by DCP into an FSDP2 model on 4 ranks: the
    same parameters bit for bit and the same logits as plait's."""
    runs, root = round_trip
    assert (root / "plait" / plait_dcp.MODEL_RECORD).is_file()
    for r in runs:
        assert r["trained_moved"] > 0, r  # the step changed the weights: a real round trip
        assert r["bit_identical_out"], r
        assert r["logits_out"] <= LOGIT_RTOL, r


def test_plait_export_defines_the_model_and_reads_back(round_trip):
    """The export records the model, so --init-from needs no settings; a DCP checkpoint
    without the record takes the run's."""
    _, root = round_trip
    assert initial_model(f"dcp:{root / 'plait'}") == MODEL
    assert initial_model(f"dcp:{root / 'titan'}") is None
    check(f"dcp:{root / 'titan'}", config(*model_sets()))


def test_bad_input_is_refused_naming_the_fix(round_trip, tmp_path):
    _, root = round_trip
    titan = f"dcp:{root / 'titan'}"
    with pytest.raises(CheckpointError, match="no such directory"):
        check(f"dcp:{tmp_path / 'missing'}", config(*model_sets()))
    with pytest.raises(CheckpointError, match="no .metadata, not a DCP checkpoint"):
        check(f"dcp:{tmp_path}", config(*model_sets()))
    other = dataclasses.replace(MODEL, dim=32, ffn_dim=48, n_layers=3)
    with pytest.raises(CheckpointError, match=r"read as torchtitan's 2026 names.*"
                       r"layers.0.attention.qkv_linear.wq.weight is \[64, 64\] there, this "
                       r"run's model needs \[32, 32\].*--set model.dim=64 "
                       r"--set model.n_layers=2 --set model.ffn_dim=90"):
        check(titan, config(*model_sets(other)))
    odd = TitanLlama(MODEL, seed=3).state_dict()  # no head, a bias plait has no place for
    odd.pop("lm_head.weight")
    odd["layers.1.attention.qkv_linear.wq.bias"] = torch.zeros(MODEL.dim)
    with plait_dcp.quiet_dcp():
        dcp.save(odd, checkpoint_id=tmp_path / "odd", no_dist=True)
    with pytest.raises(CheckpointError, match=r"lm_head.weight is missing; tensors plait's "
                       r"block has no place for: layers.1.attention.qkv_linear.wq.bias.*--set "
                       r"model.tie_embeddings=true"):
        check(f"dcp:{tmp_path / 'odd'}", config(*model_sets()))
    with pytest.raises(CheckpointError, match=r"layers.0.moe.router.gate.weight is missing"):
        check(titan, config(*model_sets(), "model.n_experts=4", "model.top_k=2",
                            "model.expert_ffn_dim=32"))
    with pytest.raises(CheckpointError, match="--dcp-names 2024: choose one of 2026, 2025"):
        export(str(root / "ck"), f"dcp:{tmp_path / 'out'}", dcp_names="2024")
    with pytest.raises(CheckpointError, match="--dcp-names 2025: .*for --to dcp:OUT only"):
        export(str(root / "ck"), f"hf:{tmp_path / 'out'}", dcp_names="2025")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        export(f"dcp:{root / 'plait'}", f"dcp:{root / 'titan'}")


def test_the_commands_read_and_write_dcp(round_trip, tmp_path, capsys):
    """`plait export --from dcp:` (plait's, which records its model) to hf:, and `plait eval`
    of both: the same weights give the same loss, with no model settings given; torchtitan's
    checkpoints, which record no model, are evaluated with the model's settings, in either
    naming (said on stderr) to the same loss; a missing one is refused (exit 2)."""
    import json

    from plait.cli.main import main

    _, root = round_trip
    _titan_2025(tmp_path / "t2025")
    assert main(["export", "--from", f"dcp:{root / 'plait'}", "--to",
                 f"hf:{tmp_path / 'hf'}"]) == 0
    assert main(["export", "--from", str(root / "ck"), "--to", f"dcp:{tmp_path / 'p2025'}",
                 "--dcp-names", "2025"]) == 0
    assert "torchtitan's 2025 names" in capsys.readouterr().out
    settings = [a for s in model_sets() for a in ("--set", s)]
    losses, said = {}, {}
    for name, source, extra in (("dcp", f"dcp:{root / 'plait'}", []),
                                ("dcp2025", f"dcp:{tmp_path / 'p2025'}", []),
                                ("hf", f"hf:{tmp_path / 'hf'}", []),
                                ("titan", f"dcp:{root / 'titan'}", settings),
                                ("titan2025", f"dcp:{tmp_path / 't2025'}", settings)):
        out = tmp_path / f"{name}.json"
        code = main(["eval", "--init-from", source, "--data", str(token_file()), "--seq-len",
                     "32", "--eval-sequences", "8", "--global-batch", "8", "--metrics-out",
                     str(out), *extra])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert captured.out.startswith("loss "), captured.out
        losses[name] = json.loads(out.read_text())["loss"]
        said[name] = captured.err
    for name in ("dcp2025", "hf"):
        assert math.isclose(losses["dcp"], losses[name], rel_tol=LOGIT_RTOL), losses
    assert math.isclose(losses["titan"], losses["titan2025"], rel_tol=LOGIT_RTOL), losses
    assert not math.isclose(losses["dcp"], losses["titan"], rel_tol=1e-3), losses  # trained
    for name, naming in (("dcp", "2026"), ("dcp2025", "2025"), ("titan", "2026"),
                         ("titan2025", "2025")):
        assert f"torchtitan's {naming} names" in said[name], (name, said[name])
    assert "torchtitan" not in said["hf"]
    code = main(["eval", "--init-from", f"dcp:{tmp_path / 'missing'}", "--data",
                 str(token_file()), "--seq-len", "32"])
    assert code == 2 and "no such directory" in capsys.readouterr().err

def _titan_2025(directory: Path) -> dict[str, torch.Tensor]:
    """torchtitan's 2025 Llama (the fixture's weights: the same seed) saved by DCP."""
    state = TitanLlama(MODEL, seed=1, naming="2025").state_dict()
    with plait_dcp.quiet_dcp():
        dcp.save(state, checkpoint_id=directory, no_dist=True)
    return state


def test_a_2025_checkpoint_is_read_as_the_2026_one(round_trip, tmp_path):
    """torchtitan's older names (attention.wq, output) are found and said; every tensor
    plait reads from them is the 2026 checkpoint's of the same weights, bit for bit."""
    _, root = round_trip
    state = _titan_2025(tmp_path / "t2025")
    old = plait_dcp.DCPWeights(tmp_path / "t2025", MODEL)
    today = plait_dcp.DCPWeights(root / "titan", MODEL)
    assert (old.naming, today.naming) == ("2025", "2026")
    for directory, naming in ((tmp_path / "t2025", "2025"), (root / "titan", "2026")):
        # what plait train says of its starting weights
        said = describe_initial(f"dcp:{directory}", MODEL)
        assert said.startswith(f"dcp:{directory}: 21 tensors in torchtitan's {naming} "
                               "names (layers.N.attention."), said
    assert "(layers.N.attention.wq.weight, output.weight" in \
        plait_dcp.describe_source(tmp_path / "t2025", MODEL)
    old.check()
    for ours in plait_dcp.titan_names(MODEL):
        got = old.full(ours)
        assert torch.equal(got, state[titan_key(ours, "2025")]), ours
        assert torch.equal(got, today.full(ours)), ours


def test_export_in_either_naming_loads_into_that_torchtitan_model(round_trip, tmp_path):
    """plait's checkpoint exported with --dcp-names 2026 and 2025: each holds exactly the
    tensors of torchtitan's model of that naming (DCP loads it strictly), the same weights
    in both; neither naming loads into the other's model."""
    _, root = round_trip
    ck = str(root / "ck")
    back = {}
    for naming in ("2026", "2025"):
        out, n = export(ck, f"dcp:{tmp_path / naming}", dcp_names=naming)
        model = TitanLlama(MODEL, seed=7, naming=naming)
        state = model.state_dict()
        assert set(plait_dcp.read_metadata(out).state_dict_metadata) == set(state), naming
        assert n == len(state)
        with plait_dcp.quiet_dcp():
            dcp.load(state, checkpoint_id=out, no_dist=True)
        back[naming] = {ours: state[titan_key(ours, naming)]
                        for ours in plait_dcp.titan_names(MODEL)}
    assert all(torch.equal(back["2026"][k], back["2025"][k]) for k in back["2026"])
    for naming, other in (("2026", "2025"), ("2025", "2026")):
        with plait_dcp.quiet_dcp(), pytest.raises(dcp.CheckpointException,
                                                  match="Missing key"):
            dcp.load(TitanLlama(MODEL, seed=7, naming=other).state_dict(),
                     checkpoint_id=tmp_path / naming, no_dist=True)
