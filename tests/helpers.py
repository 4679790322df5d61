"""Shared test plumbing: run plait's training on N forked ranks and the reference."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

from plait.config import Config, load_config
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file, write_token_file
from plait.train.loop import TrainOptions, full_state, train
from plait.train.reference import Reference, reference_run

# float64: the parity oracle's precision (docs/parity.md); tests of memory, which the
# planner models for fp32 and bf16 runs, set their precision themselves
BASE = ["train.steps=4", "train.global_batch=8", "train.seq_len=32", "train.warmup_steps=1",
        "model.vocab_size=256", "train.grad_clip=0.5", "train.precision=fp64"]
ELEMENT_BYTES = 8  # a float64 element: what the ledger counts for a tensor of these runs


# This process's own temporary root (a pytest-xdist worker, or a script that imports the
# tests' modules): made when this module is first imported, so that every rank forked later
# inherits the same path; two test sessions on one machine never share a folder. Removed at
# the process's exit (forked ranks leave through os._exit, which skips it).
SESSION_ROOT = Path(tempfile.mkdtemp(prefix="plait-tests-"))
atexit.register(shutil.rmtree, SESSION_ROOT, ignore_errors=True)


def session_dir(name: str) -> Path:
    """A folder of this test session's own root (for files several tests of a module share)."""
    path = SESSION_ROOT / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@cache
def token_file() -> Path:
    path = SESSION_ROOT / "synthetic-256.bin"
    if not path.exists():
        synthetic_token_file(path, 60_000, 256, seed=7)
    return path


def config(*sets: str) -> Config:
    return load_config(sets=[*BASE, *sets])


END_OF_DOCUMENT = 3  # the documents file's end-of-document token


@cache
def documents_file() -> Path:
    """Packed documents of 1 to 40 tokens (the windows of 32 hold several, and cut some),
    each ended by END_OF_DOCUMENT; no other."""
    import torch

    gen = torch.Generator().manual_seed(11)
    ids: list[int] = []
    while len(ids) < 20_000:
        n = int(torch.randint(1, 41, (1,), generator=gen))
        doc = torch.randint(4, 256, (n,), generator=gen)
        doc[1::2] = (doc[::2][: len(doc[1::2])] * 7) % 252 + 4  # learnable pairs
        ids += [*doc.tolist(), END_OF_DOCUMENT]
    return write_token_file(SESSION_ROOT / "documents.bin", ids, 256,
                            {"end_of_document": END_OF_DOCUMENT})


def batches_for(cfg: Config) -> GlobalBatches:
    """The global batches of `cfg`: the documents file's with `train.documents`, the
    synthetic file's otherwise."""
    path = documents_file() if cfg.train.documents else token_file()
    return GlobalBatches(TokenFile.open(path), cfg.train.seq_len,
                         cfg.train.global_batch, cfg.train.seed, cfg.model.vocab_size)


def _train_rank(rank: int, world: int, sets: list[str]):
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg), TrainOptions(capture_first_grads=True))
    # dp shards (ZeRO) and tp shards gathered; a pipeline rank gives its stages' parameters
    params = full_state(result.model, result.optimizer, mesh, result.placements)
    return {"losses": result.losses, "params": params,
            "grad_norms": [m["grad_norm"] for m in result.metrics],
            "first_grads": result.first_grads,
            "metrics": result.metrics, "summary": result.summary,
            "ledger": mesh.ledger.to_dicts()}


def moe_biases(model) -> dict:
    """The balancing bias of every MoE block this rank holds, named as the reference names
    them (`layers.N.mlp.bias`: a pipeline stage's own prefix dropped)."""
    import re

    from plait.parallel.expert import moe_layers

    stages = getattr(model, "stages", None)
    stages = stages.values() if stages is not None else [model]
    return {re.sub(r"^.*?(layers\.\d+\.mlp)$", r"\1", n) + ".bias": m.bias.clone()
            for n, m in moe_layers(stages)}


def run_layout(*sets: str) -> list[dict]:
    """Train the layout given by `sets` on as many ranks as it needs; results by rank."""
    world = config(*sets).parallel.world_size
    token_file()  # made once in the parent, before the ranks fork
    return run_ranks(_train_rank, world, list(sets))


@cache
def shared_run(*sets: str) -> list[dict]:
    """`run_layout(*sets)` made once per test process: the tests of a file that check
    different things of one run (parity, ledger bytes, overlap) read the same result, and
    must not modify it."""
    return run_layout(*sets)


@cache
def reference(*sets: str) -> Reference:
    """The single-process fp32 oracle for the model and training settings of `sets`."""
    cfg = config(*sets)
    return reference_run(cfg, batches_for(cfg))


@cache
def initial_params(*sets: str) -> dict:
    """The initial fp32 weights (every layout starts from them): bf16's movement bound."""
    cfg = config(*sets)
    return {n: p.detach().clone() for n, p in build_model(cfg.model, seed=cfg.train.seed)
            .named_parameters()}


CLI_STEPS = 3


def cli_pipeline_run(d: Path) -> dict:
    """`plait train --nproc 2 --pp 2` with the memory step measured, metrics in d/m.jsonl
    and, where installed, the TensorBoard (d/tb) and offline W&B (d/wb) sinks: its rows,
    summary and directory."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    sinks = []
    if importlib.util.find_spec("tensorboard"):
        sinks += ["--tensorboard", str(d / "tb")]
    if importlib.util.find_spec("wandb"):
        sinks += ["--wandb", "plait-test", "--wandb-dir", str(d / "wb")]
    # W&B's own cache and settings land in the test's directory, not the home directory
    env = {**os.environ, **{f"WANDB_{k}_DIR": str(d / k.lower())
                            for k in ("CACHE", "CONFIG", "DATA")}}
    r = subprocess.run(
        [sys.executable, "-m", "plait.cli", "train", "--nproc", "2", "--pp", "2",
         "--microbatches", "2", "--data", str(token_file()), "--set", "model.vocab_size=256",
         "--seq-len", "32", "--global-batch", "8", "--steps", str(CLI_STEPS), "--set",
         "train.memory_step=1", "--metrics-out", str(d / "m.jsonl"), *sinks, "--quiet"],
        capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in (d / "m.jsonl").read_text().splitlines()]
    return {"dir": d, "metrics": lines[:-1], "summary": lines[-1], "path": d / "m.jsonl"}


# ---- measured memory against the planner's eager model (plait.plan.runtime_memory) ---------------
# tracker category -> planner categories
MEMORY_CATS = {"params": ("parameters",), "grads": ("gradients",),
               "optimizer": ("optimizer states",), "comm": ("communication buffers",),
               "activations": ("activations", "logits")}
# Every category is held to 5 % of the measured bytes, or to 64 bytes where it is (near) 0
# (e.g. no buffers at the peak): 5 % of nothing is no bound.
MEMORY_SLACK = 64


def assert_memory_matches(measured: dict, total: int, pred: dict, where: str,
                          rel: float = 0.05) -> None:
    """The peak total and every category at the predicted peak moment within 5 %.

    Deterministic: every buffer is freed where the program drops it (Handle.wait() waits
    for gloo to let go of it: otherwise which moment topped the peak could vary with
    thread scheduling), so no tied-moment allowance is needed."""
    assert abs(total - pred["total"]) <= rel * pred["total"], (where, "total", total, pred)
    split = all(abs(measured[cat] - sum(pred[n] for n in names))
                <= max(rel * measured[cat], MEMORY_SLACK) for cat, names in MEMORY_CATS.items())
    assert split, f"{where}: measured {measured} (total {total}); predicted peak {pred}"


def data_windows(cfg: Config) -> int:
    """seq_len windows of the test token file: the loader's permutation the eager model
    counts (nothing else is left out)."""
    return (len(TokenFile.open(token_file())) - 1) // cfg.train.seq_len


def assert_ranks_memory_match(outs: list[dict], cfg: Config, where: str) -> None:
    """Every rank's measured peak (`train.memory_step=1`) against the eager model of its
    pipeline rank (mesh order tp, cp, pp, dp: innermost first)."""
    from plait.plan.runtime_memory import eager_memory_by_rank

    by_pp = eager_memory_by_rank(cfg, data_windows(cfg))
    stride = cfg.parallel.tp * cfg.parallel.cp
    for rank, out in enumerate(outs):
        mem = out["metrics"][1]["memory"]
        assert_memory_matches(mem["peak"], mem["peak_total"],
                              by_pp[(rank // stride) % cfg.parallel.pp], f"{where} rank {rank}")



def assert_restarted_run_matches(metrics: Path, ck: Path, steps: int, layout: tuple) -> None:
    """A launched run restarted once (one step lost): each step logged once, and its losses,
    grad norms and last checkpoint's parameters within parity of the single-process run."""
    import json

    import torch

    from plait.checkpoint.format import read_metadata
    from plait.checkpoint.reader import full_tensor
    from plait.testing import assert_parity

    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    body, summary = rows[:-1], rows[-1]
    assert [r["step"] for r in body] == list(range(steps)), [r["step"] for r in body]
    assert summary["restarts"] == 1 and summary["lost_steps"] == 1, summary
    path = ck / f"step-{steps:08d}"
    meta = read_metadata(path)
    params = {n: torch.from_numpy(full_tensor(path, meta, n)) for n in meta["tensors"]}
    assert_parity({"losses": [r["loss"] for r in body],
                   "grad_norms": [r["grad_norm"] for r in body], "params": params},
                  reference(*layout, f"train.steps={steps}"))


def plan_cli(*argv: str) -> tuple[int, str]:
    """`plait plan ARGV` in this process: (exit code, what it printed)."""
    import argparse
    import io

    from plait.plan.cli import add_parser, run

    parser = argparse.ArgumentParser(prog="plait")
    add_parser(parser.add_subparsers(dest="cmd"))
    out = io.StringIO()
    return run(parser.parse_args(["plan", *argv]), out=out), out.getvalue()
