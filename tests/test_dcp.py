"""torch.distributed.checkpoint (DCP) in and out, against the real thing: a Llama-shaped torch
model with torchtitan's names, sharded by FSDP2 (`fully_shard`) on gloo ranks, saved by
DCP, read by plait under another layout; plait's export read back by DCP into FSDP2."""

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
from plait.checkpoint.init_from import check, initial_model
from plait.checkpoint.interop import export
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.presets import ModelConfig
from plait.model.transformer import Transformer, build_model
from plait.parallel.parallelize import parallelize
from plait.train.loop import full_state, train

# GQA (2 KV heads of 4) so that the KV head order matters; untied, as torchtitan's Llama;
# ffn_dim 90: a tp2 rank's w1 has 45 rows, so ZeRO-3's halves of it end mid-row
MODEL = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=90,
                    max_seq_len=64, rope_theta=500000.0)
LOGIT_RTOL = 1e-5  # fp32, the largest logit's share (tests/test_hf.py's bound)
LAYOUT = ("parallel.dp=2", "parallel.zero=3", "parallel.tp=2")  # boxes and flat runs


# ---- a Llama with torchtitan's module names (torchtitan/models/llama3/model/model.py) -----

class TitanAttention(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.heads, self.kv, self.hd = m.n_heads, m.n_kv_heads, m.head_dim
        self.wq = nn.Linear(m.dim, m.n_heads * m.head_dim, bias=False)
        self.wk = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=False)
        self.wv = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=False)
        self.wo = nn.Linear(m.n_heads * m.head_dim, m.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd)
        k = self.wk(x).view(b, s, self.kv, self.hd)
        v = self.wv(x).view(b, s, self.kv, self.hd)

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
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.attention = TitanAttention(m)
        self.feed_forward = TitanFeedForward(m.dim, m.ffn_dim)
        self.attention_norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        self.ffn_norm = nn.RMSNorm(m.dim, eps=m.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, m: ModelConfig, seed: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(m.vocab_size, m.dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(m) for i in range(m.n_layers)})
        self.norm = nn.RMSNorm(m.dim, eps=m.norm_eps)
        self.output = nn.Linear(m.dim, m.vocab_size, bias=False)
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
        return self.output(self.norm(h))


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
    requested = plait_dcp.load_into(par, mesh, cfg, root / "titan")
    loaded = full_state(par.model, par.optimizer, mesh, par.placements)
    out = {"requested": requested,
           "bit_identical_in": all(torch.equal(t, ref_params[plait_dcp.titan_name(n)])
                                   for n, t in loaded.items()),
           "logits_in": rel_diff(plait_logits(loaded, tokens), ref_logits)}

    ck = Checkpointing(dir=root / "ck", final=True)  # one step, then out through DCP
    result = train(cfg, mesh, batches_for(cfg), checkpoint=ck)
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
    out["bit_identical_out"] = all(torch.equal(t, back_params[plait_dcp.titan_name(n)])
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
    with pytest.raises(CheckpointError, match=r"layers.0.attention.wq.weight is \[64, 64\] "
                       r"there, this run's model needs \[32, 32\].*--set model.dim=64 "
                       r"--set model.n_layers=2 --set model.ffn_dim=90"):
        check(titan, config(*model_sets(other)))
    odd = TitanLlama(MODEL, seed=3).state_dict()  # no output, a bias plait has no place for
    odd.pop("output.weight")
    odd["layers.1.attention.wq.bias"] = torch.zeros(MODEL.dim)
    with plait_dcp.quiet_dcp():
        dcp.save(odd, checkpoint_id=tmp_path / "odd", no_dist=True)
    with pytest.raises(CheckpointError, match=r"output.weight is missing; tensors plait's "
                       r"block has no place for: layers.1.attention.wq.bias.*--set "
                       r"model.tie_embeddings=true"):
        check(f"dcp:{tmp_path / 'odd'}", config(*model_sets()))
    with pytest.raises(CheckpointError, match="dense Llama models only"):
        check(titan, config(*model_sets(), "model.n_experts=4", "model.top_k=2",
                            "model.expert_ffn_dim=32"))
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        export(f"dcp:{root / 'plait'}", f"dcp:{root / 'titan'}")


def test_the_commands_read_and_write_dcp(round_trip, tmp_path, capsys):
    """`plait export --from dcp:` (plait's, which records its model) to hf:, and `plait eval`
    of both: the same weights give the same loss; a torchtitan checkpoint, which records no
    model, is evaluated with the model's settings; a missing one is refused (exit 2)."""
    import json

    from plait.cli.main import main

    _, root = round_trip
    assert main(["export", "--from", f"dcp:{root / 'plait'}", "--to",
                 f"hf:{tmp_path / 'hf'}"]) == 0
    losses = {}
    for name, source, extra in (("dcp", f"dcp:{root / 'plait'}", []),
                                ("hf", f"hf:{tmp_path / 'hf'}", []),
                                ("titan", f"dcp:{root / 'titan'}",
                                 [a for s in model_sets() for a in ("--set", s)])):
        out = tmp_path / f"{name}.json"
        code = main(["eval", "--init-from", source, "--data", str(token_file()), "--seq-len",
                     "32", "--eval-sequences", "8", "--global-batch", "8", "--metrics-out",
                     str(out), *extra])
        assert code == 0, capsys.readouterr().err
        losses[name] = json.loads(out.read_text())["loss"]
    assert math.isclose(losses["dcp"], losses["hf"], rel_tol=LOGIT_RTOL), losses
    assert not math.isclose(losses["dcp"], losses["titan"], rel_tol=1e-3), losses  # trained
    capsys.readouterr()
    code = main(["eval", "--init-from", f"dcp:{tmp_path / 'missing'}", "--data",
                 str(token_file()), "--seq-len", "32"])
    assert code == 2 and "no such directory" in capsys.readouterr().err
