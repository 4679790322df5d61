"""Hugging Face models out, and the commands: export round trips bit for bit,
`plait eval`'s loss is the one transformers computes, and after training in tp=2 x pp=2
the exported model's loss under transformers is plait's final evaluation.

Tolerances: losses within 1e-5 relative (fp32; the same sums in another reduction order,
tests/test_hf.py). Nothing is downloaded: the models are tiny random LlamaConfigs saved
in temporary directories (tests/test_hf.py's `make_hf`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import config, token_file
from test_hf import LLAMA3_ROPE, hf_loss, make_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from plait.checkpoint import Checkpointing  # noqa: E402
from plait.checkpoint.hf import model_config  # noqa: E402
from plait.checkpoint.interop import export  # noqa: E402
from plait.cli.main import main  # noqa: E402
from plait.launch.forked import run_ranks  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile  # noqa: E402
from plait.train.evaluate import evaluate  # noqa: E402
from plait.train.loop import TrainOptions, train  # noqa: E402

RTOL = 1e-5
SEQ, EVAL_N = 32, 16


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hfcli") / "llama"
    make_hf(path, kv_heads=2, rope=LLAMA3_ROPE, std=0.05)
    (path / "tokenizer.json").write_text('{"stand-in": "copied, not parsed"}\n')
    return path


def file_windows(n: int, seq: int = SEQ) -> torch.Tensor:
    """The first n windows of seq + 1 tokens of the test data, in file order."""
    tokens = TokenFile.open(token_file()).tokens
    return torch.from_numpy(np.stack([np.asarray(tokens[w * seq: w * seq + seq + 1])
                                      for w in range(n)]).astype(np.int64))


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_of_an_import_is_bit_identical(hf_dir, tmp_path, dtype):
    src = hf_dir
    if dtype == "bf16":  # a bf16 source: through fp32 and back exactly
        src = tmp_path / "bf16-src"
        transformers.LlamaForCausalLM.from_pretrained(hf_dir).to(torch.bfloat16
                                                                 ).save_pretrained(src)
    out, n = export(f"hf:{src}", f"hf:{tmp_path / 'out'}", dtype)
    want = safetensors_torch.load_file(src / "model.safetensors")
    got = safetensors_torch.load_file(out / "model.safetensors")
    assert n == len(want) and same_bits(got, want)
    assert model_config(out) == model_config(src)


def test_export_in_shards_loads_in_transformers(hf_dir, tmp_path):
    """Shards and their index, written by the safetensors library as transformers writes
    them, hold the same tensors, and transformers loads them."""
    from plait.checkpoint.hf_export import write_hf
    from plait.checkpoint.interop import into_new_dir
    from plait.checkpoint.source import Source

    out = tmp_path / "sharded"
    into_new_dir(out, lambda tmp: write_hf(Source(f"hf:{hf_dir}"), tmp, "fp32", 150_000))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    got = {k: v for f in files for k, v in safetensors_torch.load_file(out / f).items()}
    assert same_bits(got, safetensors_torch.load_file(hf_dir / "model.safetensors"))
    theirs = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in got.items())


def test_export_refuses_an_existing_directory(hf_dir, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine\n")
    code = main(["export", "--from", f"hf:{hf_dir}", "--to", f"hf:{tmp_path / 'taken'}"])
    assert code == 2 and "not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["keep.txt"]


@pytest.mark.slow  # evaluates a transformers model's windows in both libraries (~7 s)
def test_eval_command_is_transformers_loss(hf_dir, tmp_path, capsys):
    """One rank, in this process: the printed line and the JSON hold the mean CE over the
    file's first N windows, which transformers computes too."""
    out = tmp_path / "eval.json"
    code = main(["eval", "--init-from", f"hf:{hf_dir}", "--data", str(token_file()),
                 "--seq-len", str(SEQ), "--eval-sequences", str(EVAL_N), "--metrics-out",
                 str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    result = json.loads(out.read_text())
    assert text.strip().endswith(f"loss {result['loss']:.6f} perplexity "
                                 f"{result['perplexity']:.4f}")
    assert math.isclose(result["perplexity"], math.exp(result["loss"]))
    assert result["sequences"] == EVAL_N and result["tokens"] == EVAL_N * SEQ
    theirs = hf_loss(hf_dir, file_windows(EVAL_N))
    assert math.isclose(result["loss"], theirs, rel_tol=RTOL), (result["loss"], theirs)
    # two ranks through torchrun (python -m plait.train eval): the same windows, the same loss
    out2 = tmp_path / "eval-dp2.json"
    code = main(["eval", "--init-from", f"hf:{hf_dir}", "--data", str(token_file()),
                 "--seq-len", str(SEQ), "--eval-sequences", str(EVAL_N), "--dp", "2",
                 "--metrics-out", str(out2)])
    assert code == 0, capsys.readouterr().err
    two = json.loads(out2.read_text())
    assert math.isclose(two["loss"], result["loss"], rel_tol=RTOL), (two, result)
    assert two["layout"].startswith("dp=2")


def test_export_of_a_plait_model_loads_in_transformers(tmp_path):
    """A model plait initialised itself (no Hugging Face origin: config.json is written by
    plait, Llama 3 scaling included) loads in transformers with plait's loss. init_std
    0.3 makes attention sharp enough that the scaling matters (the control at the end:
    without it the loss moves by ~2e-3, far past the tolerance)."""
    sets = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=88",
            "model.max_seq_len=64", "model.rope_scaling_factor=8.0", "model.init_std=0.3",
            "model.rope_original_max_len=16", "model.rope_theta=500000.0", "train.steps=1",
            f"train.seq_len={SEQ}"]
    token_file()
    run = run_ranks(_train_then_eval, 1, sets, str(tmp_path / "ck"))[0]
    out, _ = export(run["checkpoint"], f"hf:{tmp_path / 'plait-model'}")
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    theirs = hf_loss(out, file_windows(EVAL_N))
    assert math.isclose(run["eval"], theirs, rel_tol=RTOL), (run["eval"], theirs)
    c = json.loads((out / "config.json").read_text())
    c.update(rope_scaling=None, rope_parameters={"rope_type": "default",
                                                 "rope_theta": c["rope_theta"]})
    (out / "config.json").write_text(json.dumps(c))
    unscaled = hf_loss(out, file_windows(EVAL_N))
    assert not math.isclose(unscaled, theirs, rel_tol=100 * RTOL), (unscaled, theirs)


def _train_then_eval(rank: int, world: int, sets: list[str], root: str) -> dict:
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    batches = GlobalBatches(TokenFile.open(token_file()), cfg.train.seq_len,
                            cfg.train.global_batch, cfg.train.seed, cfg.model.vocab_size)
    ck = Checkpointing(dir=Path(root), every=cfg.train.steps)
    result = train(cfg, mesh, batches, TrainOptions(checkpoint=ck))
    saved = str(ck.saved[-1])
    cfg_eval = config(*sets, f"train.init_from={saved}").check(world)
    ev = evaluate(cfg_eval, ParallelMesh.build(cfg.parallel), TokenFile.open(token_file()),
                  EVAL_N)
    return {"losses": result.losses, "eval": ev["loss"], "checkpoint": saved}


def test_train_in_tp_pp_export_and_transformers_agrees(hf_dir, tmp_path):
    """The proof: start from the Hugging Face model in tp=2 x pp=2, train 3 steps, save,
    evaluate in the same layout; export the checkpoint; transformers' loss on the same
    windows is plait's."""
    model = model_config(hf_dir)
    sets = [*(f"model.{k}={v}" for k, v in dataclasses.asdict(model).items()),
            f"train.init_from=hf:{hf_dir}", "train.steps=3", "parallel.tp=2",
            "parallel.pp=2", f"train.seq_len={SEQ}", "train.lr=1e-2"]
    token_file()
    runs = run_ranks(_train_then_eval, 4, sets, str(tmp_path / "ck"))
    ours = runs[0]["eval"]
    assert all(r["eval"] == ours for r in runs)
    assert runs[0]["losses"][-1] < runs[0]["losses"][0]  # it trained: the weights moved
    out, _ = export(runs[0]["checkpoint"], f"hf:{tmp_path / 'trained'}")
    assert (out / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()
    theirs = hf_loss(out, file_windows(EVAL_N))
    before = hf_loss(hf_dir, file_windows(EVAL_N))
    print(f"eval loss: plait {ours:.7f}, transformers {theirs:.7f} (before training "
          f"{before:.7f})")
    assert math.isclose(ours, theirs, rel_tol=RTOL), (ours, theirs)
    assert not math.isclose(theirs, before, rel_tol=1e-3)


@pytest.mark.slow  # torchrun
def test_train_command_starts_from_the_hf_model(hf_dir, tmp_path, capsys):
    """Through `plait train` (torchrun, 2 ranks, tp=2): the first loss is transformers'."""
    out = tmp_path / "m.jsonl"
    code = main(["train", "--init-from", f"hf:{hf_dir}", "--data", str(token_file()),
                 "--tp", "2", "--steps", "1", "--seq-len", str(SEQ), "--global-batch", "8",
                 "--quiet", "--metrics-out", str(out)])
    assert code == 0, capsys.readouterr().err
    first = json.loads(out.read_text().splitlines()[0])["loss"]
    cfg = config(f"train.seq_len={SEQ}")
    batches = GlobalBatches(TokenFile.open(token_file()), SEQ, 8, cfg.train.seed, 256)
    theirs = hf_loss(hf_dir, batches.rows(0))
    assert math.isclose(first, theirs, rel_tol=RTOL), (first, theirs)


def test_data_prepare_jsonl_with_the_models_tokenizer(tmp_path, capsys):
    """`--tokenizer hf:DIR` reads DIR/tokenizer.json; each .jsonl line (field `--text-field`)
    is one document, the model's end-of-sequence id (config.json eos_token_id) after each."""
    from tokenizers import Tokenizer

    from plait.train.corpus import train_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    text = tmp_path / "seed.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    train_tokenizer([text], 300).save(str(model / "tokenizer.json"))
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320,
                                                   "eos_token_id": 0}))
    docs = ["the quick fox", "a lazy dog jumps", "over the brown"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"body": d, "id": i}) + "\n"
                            for i, d in enumerate(docs)))
    out = tmp_path / "t.bin"
    code = main(["data", "prepare", str(rows), "--tokenizer", f"hf:{model}", "--text-field",
                 "body", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    want = [i for d in docs for i in [*tok.encode(d).ids, 0]]
    data = TokenFile.open(out)
    assert list(data.tokens) == want
    assert data.meta["documents"] == 3 and data.meta["end_of_document"] == 0
