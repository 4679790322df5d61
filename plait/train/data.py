"""Token data: a memory-mapped token file and a layout-independent global batch.

A token file is `NAME.bin` (raw uint16 or uint32 ids) with `NAME.json` beside it:
{"dtype": "uint16", "num_tokens": T, "vocab_size": V, "max_token_id": M, "tokenizer": ...}.
The file is cut into windows of seq_len + 1 tokens (inputs and shifted targets); each epoch
visits the windows in an order drawn from the seed. The global batch of step k is the
windows k*B .. (k+1)*B - 1 of that order, whatever the layout: data-parallel rank r takes
rows r*B/dp .. (r+1)*B/dp - 1, then cuts them into micro-batches. So the batch of a step
depends on (file, seed, seq_len, global batch, step) only, and resuming at step k is exact.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """The token data cannot serve this configuration; the message says what to change."""


@dataclass
class TokenFile:
    path: Path
    tokens: np.ndarray  # memory-mapped
    meta: dict

    @classmethod
    def open(cls, path: str | Path) -> TokenFile:
        path = Path(path)
        if path.suffix != ".bin":  # never read a different file than the one named
            raise DataError(not_a_token_file(path))
        meta_path = path.with_suffix(".json")
        if not path.is_file() or not meta_path.is_file():
            raise DataError(
                f"token file {path} (with {meta_path.name} beside it) not found; run "
                "`plait data prepare` or pass --data PATH.bin")
        meta = _read_meta(meta_path)
        dtype = meta.get("dtype")
        if dtype not in DTYPES:
            raise DataError(f"{meta_path}: dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        size = path.stat().st_size
        if size % itemsize or size // itemsize != meta.get("num_tokens", size // itemsize):
            raise DataError(f"{path}: {size} bytes do not hold the {meta.get('num_tokens')} "
                            f"{dtype} tokens its metadata promises; prepare it again")
        if size == 0:
            raise DataError(f"{path} holds no tokens; prepare it again from more text")
        tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r")
        if "max_token_id" not in meta:
            meta["max_token_id"] = int(tokens.max()) if len(tokens) else -1
        return cls(path, tokens, meta)

    def __len__(self) -> int:
        return len(self.tokens)


def not_a_token_file(path: Path) -> str:
    """What to do with a --data path that does not end in .bin."""
    token_file = path.with_suffix(".bin")
    if path.suffix == ".json" and token_file.is_file():
        return (f"{path} is the metadata of the token file {token_file}; pass "
                f"--data {token_file}")
    if path.is_file() and _looks_like_text(path):
        return (f"{path} is text, not a token file; tokenize it first: plait data prepare "
                f"{path} --out {token_file}, then --data {token_file}")
    return (f"{path}: a token file is NAME.bin with NAME.json beside it (plait data "
            "prepare writes them); pass the .bin file")


def _looks_like_text(path: Path, probe: int = 4096) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(probe)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a character cut at the probe's end is still text
        return e.start >= len(head) - 3
    return True


def _read_meta(meta_path: Path) -> dict:
    """A token file's JSON metadata; a corrupt or foreign one is a DataError."""
    fix = "prepare the token file again (plait data prepare)"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is not readable token-file metadata ({e}); {fix}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path} holds {type(meta).__name__}, not token-file metadata; "
                        f"{fix}")
    for key in ("num_tokens", "vocab_size", "max_token_id"):
        if key in meta and (not isinstance(meta[key], int) or isinstance(meta[key], bool)):
            raise DataError(f"{meta_path}: {key}={meta[key]!r} is not an integer; {fix}")
    return meta


def write_token_file(path: str | Path, ids: np.ndarray | list[int], vocab_size: int,
                     extra: dict | None = None) -> Path:
    """Write ids as NAME.bin + NAME.json atomically (temp files renamed into place)."""
    path = Path(path).with_suffix(".bin")
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise DataError(f"token ids span [{ids.min()}, {ids.max()}], outside the vocabulary "
                        f"of {vocab_size}")
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    meta = {"dtype": dtype, "num_tokens": int(ids.size), "vocab_size": int(vocab_size),
            "max_token_id": int(ids.max()) if ids.size else -1, **(extra or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f".{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # unique per writer, threads too
    tmp_bin, tmp_meta = path.with_suffix(".bin" + tag), path.with_suffix(".json" + tag)
    try:
        ids.astype(DTYPES[dtype]).tofile(tmp_bin)
        tmp_meta.write_text(json.dumps(meta, indent=1))
        # the metadata first: a reader that sees NAME.bin always finds its NAME.json
        tmp_meta.replace(path.with_suffix(".json"))
        tmp_bin.replace(path)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
    return path


def end_of_document(data: TokenFile) -> int:
    """The token that ends each document (`plait data prepare` writes it after every one,
    and its id in the metadata): what packed documents split windows at."""
    eot = data.meta.get("end_of_document")
    if not isinstance(eot, int) or isinstance(eot, bool):
        raise DataError(
            f"{data.path} records no end-of-document token, so its document boundaries "
            "are lost; prepare it again with `plait data prepare` (a tokenizer with "
            "<|endoftext|>, or --tokenizer hf:DIR) or train without --documents")
    return eot


class GlobalBatches:
    """The global batch of every step, and each data-parallel rank's slice of it."""

    def __init__(self, data: TokenFile, seq_len: int, global_batch: int, seed: int,
                 vocab_size: int):
        self.data, self.seq_len, self.global_batch, self.seed = data, seq_len, global_batch, seed
        self.n_windows = (len(data) - 1) // seq_len
        if data.meta["max_token_id"] >= vocab_size:
            raise DataError(
                f"{data.path} holds token id {data.meta['max_token_id']} but the model's "
                f"vocabulary has {vocab_size} ids; set model.vocab_size >= "
                f"{data.meta['max_token_id'] + 1} or use a matching tokenizer")
        if self.n_windows < global_batch:
            raise DataError(
                f"{data.path} has {len(data)} tokens: {self.n_windows} windows of seq_len "
                f"{seq_len}, fewer than one global batch of {global_batch}; use more data, "
                "a shorter --seq-len or a smaller --global-batch")
        self._orders: dict[int, torch.Tensor] = {}

    def end_of_document(self) -> int:
        """The file's end-of-document token (`end_of_document`)."""
        return end_of_document(self.data)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.n_windows, generator=gen)}
        return self._orders[epoch]

    def window_ids(self, step: int, lo: int = 0, hi: int | None = None) -> list[int]:
        """Window ids of rows lo..hi-1 of the global batch of `step`."""
        hi = self.global_batch if hi is None else hi
        out = []
        for i in range(step * self.global_batch + lo, step * self.global_batch + hi):
            epoch, pos = divmod(i, self.n_windows)
            out.append(int(self._order(epoch)[pos]))
        return out

    def rows(self, step: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """(hi - lo, seq_len + 1) int64 tokens: rows lo..hi-1 of step `step`'s global batch."""
        s = self.seq_len
        rows = [np.asarray(self.data.tokens[w * s: w * s + s + 1])
                for w in self.window_ids(step, lo, hi)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """This data-parallel rank's rows of the global batch of `step` (reads only those)."""
        per = self.global_batch // dp_size
        return self.rows(step, dp_rank * per, (dp_rank + 1) * per)


def synthetic_token_file(path: str | Path, num_tokens: int, vocab_size: int,
                         seed: int = 0) -> Path:
    """A learnable synthetic corpus (noisy repeated n-gram patterns) for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.randint(0, vocab_size, (32, 16), generator=gen)
    picks = torch.randint(0, 32, (num_tokens // 16 + 1,), generator=gen)
    ids = patterns[picks].reshape(-1)[:num_tokens].clone()
    noise = torch.rand(num_tokens, generator=gen) < 0.1
    ids[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=gen)
    return write_token_file(path, ids.numpy(), vocab_size, {"source": "synthetic"})
