"""Shared test plumbing: run plait's training on N forked ranks and the reference."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from plait.config import Config, load_config
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.testing import run_ranks
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file
from plait.train.loop import full_state, train
from plait.train.reference import Reference, reference_run

BASE = ["train.steps=4", "train.global_batch=8", "train.seq_len=32", "train.warmup_steps=1",
        "model.vocab_size=256", "train.grad_clip=0.5"]


@cache
def token_file(tmp_root: str = "/tmp/plait-tests") -> Path:
    path = Path(tmp_root) / "synthetic-256.bin"
    if not path.exists():
        synthetic_token_file(path, 60_000, 256, seed=7)
    return path


def config(*sets: str) -> Config:
    return load_config(sets=[*BASE, *sets])


def batches_for(cfg: Config) -> GlobalBatches:
    return GlobalBatches(TokenFile.open(token_file()), cfg.train.seq_len,
                         cfg.train.global_batch, cfg.train.seed, cfg.model.vocab_size)


def _train_rank(rank: int, world: int, sets: list[str]):
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg), capture_first_grads=True)
    # dp shards (ZeRO) and tp shards gathered; a pipeline rank gives its stages' parameters
    params = full_state(result.model, result.optimizer, mesh, result.placements)
    return {"losses": result.losses, "params": params,
            "grad_norms": [m["grad_norm"] for m in result.metrics],
            "first_grads": result.first_grads,
            "metrics": result.metrics, "summary": result.summary,
            "ledger": mesh.ledger.to_dicts()}


def run_layout(*sets: str) -> list[dict]:
    """Train the layout given by `sets` on as many ranks as it needs; results by rank."""
    world = config(*sets).parallel.world_size
    token_file()  # made once in the parent, before the ranks fork
    return run_ranks(_train_rank, world, list(sets))


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
