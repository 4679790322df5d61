"""`plait eval`: mean token cross-entropy and perplexity of a model over a token file's
first N windows, in file order, in any layout (docs/huggingface.md).

Window w is tokens [w*S, w*S + S] (S + 1 tokens: inputs and shifted targets), the
windows `GlobalBatches` cuts, taken in order, not shuffled: batch b is windows
b*B .. (b+1)*B - 1 (B = train.global_batch), data-parallel rank r its rows as in
training. So the windows, and the loss, are the same whatever the layout.

Each batch runs the training schedule's forwards only, without gradients
(plait/train/held_out.py, the loss validation during training reports too).
"""

from __future__ import annotations

from plait.checkpoint.init_from import load_initial
from plait.config import Config
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.parallel.parallelize import parallelize
from plait.train.data import DataError, TokenFile
from plait.train.held_out import HeldOut, perplexity


def eval_windows(data: TokenFile, seq_len: int) -> int:
    """Whole windows of seq_len + 1 tokens the file holds."""
    return (len(data) - 1) // seq_len


def eval_problems(cfg: Config, data: TokenFile, sequences: int | None) -> list[str]:
    """Why these windows cannot be evaluated with this configuration."""
    t = cfg.train
    have = eval_windows(data, t.seq_len)
    n = sequences if sequences is not None else have - have % t.global_batch
    if n < 1:
        return [f"--eval-sequences {n}: evaluate at least one batch of {t.global_batch} "
                f"windows ({data.path} holds {have} of seq_len {t.seq_len})"]
    problems = []
    if n > have:
        problems.append(f"--eval-sequences {n}: {data.path} holds only {have} windows of "
                        f"{t.seq_len} + 1 tokens; ask for at most {have}")
    if n % t.global_batch:
        problems.append(f"--eval-sequences {n} is not a multiple of the eval batch "
                        f"(--global-batch {t.global_batch}); use "
                        f"{max(n - n % t.global_batch, t.global_batch)} or a --global-batch "
                        f"that divides {n}")
    if data.meta["max_token_id"] >= cfg.model.vocab_size:
        problems.append(f"{data.path} holds token id {data.meta['max_token_id']}, past the "
                        f"model's vocabulary of {cfg.model.vocab_size}; use data prepared "
                        "with the model's tokenizer")
    return problems


def evaluate(cfg: Config, mesh: ParallelMesh, data: TokenFile, sequences: int | None
             ) -> dict:
    """Every rank: the mean token cross-entropy (nats) and perplexity over the first
    `sequences` windows (None: every whole batch of the file), of the model
    `cfg.train.init_from` (or the name-seeded init without it)."""
    problems = eval_problems(cfg, data, sequences)
    if problems:
        raise DataError("; ".join(problems))
    t = cfg.train
    s, rows_per_batch = t.seq_len, t.global_batch
    have = eval_windows(data, s)
    n = sequences if sequences is not None else have - have % rows_per_batch
    par = parallelize(build_model(cfg.model, seed=t.seed, device="meta"), mesh, cfg)
    if t.init_from is not None:
        load_initial(par, mesh, cfg, t.init_from)
    loss = HeldOut(cfg, mesh, par, data, n).loss()
    return {"loss": loss, "perplexity": perplexity(loss), "sequences": n, "seq_len": s,
            "tokens": n * s, "layout": mesh.describe(), "init_from": t.init_from,
            "data": str(data.path)}
