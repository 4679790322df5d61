"""The loss of a model on held-out windows, forward only, in any layout: validation during
training (`plait train --eval-every N --eval-data FILE`) and `plait eval`.

The windows are the first n of the held-out token file in file order (window w is tokens
[w*S, w*S + S], S = train.seq_len), n = train.eval_sequences or every whole global batch
the file holds; batch b is windows b*B .. (b+1)*B - 1 (B the global batch) and
data-parallel rank r takes its rows of each as in training. So the windows, and the loss,
are the same whatever the layout, as the training batch is.

Each batch runs the training schedule's forwards and their activation transfers only
(`lower.forward_only`) under `torch.no_grad`: tensor, sequence, context and expert
parallel, ZeRO-3's gathers and the pipeline work as in training, and nothing is kept for
a backward, no gradient is written, no optimizer state changes. Each micro-batch's summed
loss is divided by all the n windows' (kept) targets, so the sum over batches, stages,
sequence slices and replicas (ledger tag "metrics") is the mean over every one.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from plait import comm
from plait.config import Config
from plait.dims import LOSS_SUMMED
from plait.mesh import ParallelMesh
from plait.parallel.context import documents_positions
from plait.parallel.parallelize import ParallelModel, model_dtype
from plait.parallel.pipeline.runtime import PipelineRuntime
from plait.schedule.lower import forward_only
from plait.train.data import DataError, TokenFile, end_of_document


def held_out_windows(data: TokenFile, seq_len: int) -> int:
    """Whole windows of seq_len + 1 tokens the file holds."""
    return (len(data) - 1) // seq_len


def held_out_count(cfg: Config, data: TokenFile, batch: int | None = None) -> int:
    """The windows evaluated: train.eval_sequences, or every whole batch of `batch`
    windows (default the global batch) the file holds."""
    if cfg.train.eval_sequences is not None:
        return cfg.train.eval_sequences
    have, batch = held_out_windows(data, cfg.train.seq_len), batch or cfg.train.global_batch
    return have - have % batch


def held_out_problems(cfg: Config) -> list[str]:
    """Why train.eval_data cannot be evaluated with this (valid) configuration; each
    problem names the fix. Reads the file's metadata and, for documents, nothing more."""
    t = cfg.train
    try:
        data = TokenFile.open(t.eval_data)
    except DataError as e:
        return [f"--eval-data: {e}"]
    have, batch = held_out_windows(data, t.seq_len), t.global_batch
    problems = []
    if t.eval_sequences is None and have < batch:
        problems.append(f"--eval-data {data.path} holds {have} windows of seq_len {t.seq_len}"
                        f" + 1 tokens, fewer than one global batch of {batch}; use a longer "
                        "file, a shorter --seq-len or a smaller --global-batch")
    elif t.eval_sequences is not None and t.eval_sequences > have:
        problems.append(f"train.eval_sequences={t.eval_sequences}: --eval-data {data.path} "
                        f"holds only {have} windows of seq_len {t.seq_len} + 1 tokens; ask "
                        f"for at most {have - have % batch}")
    elif t.eval_sequences is not None and t.eval_sequences % batch:
        problems.append(f"train.eval_sequences={t.eval_sequences} is not a multiple of the "
                        f"global batch {batch}; use "
                        f"{max(t.eval_sequences - t.eval_sequences % batch, batch)}")
    if data.meta["max_token_id"] >= cfg.model.vocab_size:
        problems.append(f"--eval-data {data.path} holds token id {data.meta['max_token_id']},"
                        f" past the model's vocabulary of {cfg.model.vocab_size}; use data "
                        "prepared with the training data's tokenizer")
    if t.documents:
        try:
            end_of_document(data)
        except DataError as e:
            problems.append(f"--eval-data: {e}")
    return problems


class HeldOut:
    """The held-out windows of one layout's model: `loss()` on every rank, collective."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, par: ParallelModel, data: TokenFile,
                 windows: int):
        """`windows`: how many (a multiple of cfg.train.global_batch, the rows a batch)."""
        t = cfg.train
        self.cfg, self.mesh, self.data, self.windows = cfg, mesh, data, windows
        self.mbs, self.n_micro = cfg.micro_batch_size(), cfg.microbatches()
        boundary = {st.boundary_shape(self.mbs, t.seq_len) for st in par.stages.values()}
        self.runtime = PipelineRuntime(forward_only(par.schedule), par.stages, mesh,
                                       boundary.pop(), model_dtype(cfg),
                                       positions=par.positions)
        # packed documents: an end-of-document token's target is not predicted, and the
        # mean is over the targets kept in the windows (their inputs: the first n*S tokens)
        self.runtime.documents = end_of_document(data) if t.documents else None
        self.runtime.document_split = documents_positions(cfg, mesh)
        self.targets = windows * t.seq_len if self.runtime.documents is None else int(
            (np.asarray(data.tokens[:windows * t.seq_len]) != self.runtime.documents).sum())

    def _local_rows(self, batch: int) -> torch.Tensor:
        """This data-parallel rank's rows of held-out batch `batch`."""
        s, rows = self.cfg.train.seq_len, self.cfg.train.global_batch
        per = rows // self.mesh.size("dp")
        first = batch * rows + self.mesh.coord("dp") * per
        windows = [np.asarray(self.data.tokens[w * s: w * s + s + 1])
                   for w in range(first, first + per)]
        return torch.from_numpy(np.stack(windows).astype(np.int64)).to(self.mesh.device.torch)

    @torch.no_grad()
    def loss(self) -> float:
        """The mean token cross-entropy (nats) over the windows; every rank returns it."""
        total = torch.zeros(1, dtype=torch.float64, device=self.mesh.device.torch)
        mbs = self.mbs
        for b in range(self.windows // self.cfg.train.global_batch):
            rows = self._local_rows(b)
            total += self.runtime.step([rows[i * mbs:(i + 1) * mbs]
                                        for i in range(self.n_micro)], self.targets)
        for dim in LOSS_SUMMED:
            comm.all_reduce(total, self.mesh, dim, tag="metrics")
        return float(total)


def perplexity(loss: float) -> float:
    """exp(loss), infinite past float64's range rather than an OverflowError."""
    return math.exp(loss) if loss < 709.0 else math.inf
