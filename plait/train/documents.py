"""Documents in, tokens out, streamed (`plait data prepare`): memory holds one batch of
documents and their token ids (plait/train/corpus.py bounds it), whatever the corpus's size.

Inputs: a text file is one document; a `.jsonl` file is one document per line (the string
in its `text` field, or `--text-field NAME`); a `.parquet` file one per row of that column
(read by batches with pyarrow, when it is installed: it is not a plait dependency).
`TokenWriter` appends ids to a temporary `.bin` and, on `commit`, writes the `.json`
metadata and renames both into place (tokens first, as `write_token_file` does).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from plait.train.data import DTYPES, DataError

STRUCTURED = (".jsonl", ".parquet")


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {n} is not JSON ({e.msg}); fix or drop it") from None
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path} line {n} has no string field {field!r}; name the "
                                "text field with --text-field")
            yield text


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str):
                yield text


def documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one input file, in order."""
    path = Path(path)
    if path.suffix == ".jsonl":
        yield from _jsonl(path, text_field)
    elif path.suffix == ".parquet":
        yield from _parquet(path, text_field)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def structured_problem(path: Path, text_field: str) -> str | None:
    """Why a .jsonl / .parquet input cannot be read (its first record, for .jsonl)."""
    if not path.is_file():
        return f"input {path} {'is a directory' if path.is_dir() else 'not found'}"
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            return (f"{path}: reading .parquet needs the pyarrow package, not installed "
                    "(pip install pyarrow), or convert it to .jsonl")
        try:
            names = pq.ParquetFile(path).schema_arrow.names
        except Exception as e:  # pyarrow's own error types
            return f"{path} is not a readable parquet file ({str(e)[:100]})"
        if text_field not in names:
            return (f"{path} has no column {text_field!r} (columns: {', '.join(names[:8])}); "
                    "name it with --text-field")
        return None
    try:
        next(iter(_jsonl(path, text_field)), None)
    except DataError as e:
        return str(e)
    except UnicodeDecodeError as e:
        return f"{path} is not UTF-8 text (byte {e.start}); convert it to UTF-8 first"
    return None


class TokenWriter:
    """Token ids appended to NAME.bin under a temporary name; `commit` makes them NAME.bin
    with NAME.json, `abort` removes them."""

    def __init__(self, path: Path, vocab_size: int):
        self.path = Path(path).with_suffix(".bin")
        self.vocab_size = vocab_size
        self.dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
        self.count, self.max_id = 0, -1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tag = f".{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        self.tmp_bin = self.path.with_suffix(".bin" + tag)
        self.tmp_meta = self.path.with_suffix(".json" + tag)
        self._file = open(self.tmp_bin, "wb")  # noqa: SIM115 (closed by commit/abort)

    def append(self, ids: list[int]) -> None:
        if not ids:
            return
        a = np.asarray(ids, dtype=np.int64)
        if a.min() < 0 or a.max() >= self.vocab_size:
            raise DataError(f"token ids span [{a.min()}, {a.max()}], outside the vocabulary "
                            f"of {self.vocab_size}")
        self._file.write(a.astype(DTYPES[self.dtype]).tobytes())
        self.count += a.size
        self.max_id = max(self.max_id, int(a.max()))

    def commit(self, extra: dict) -> Path:
        self._file.close()
        meta = {"dtype": self.dtype, "num_tokens": self.count, "vocab_size": self.vocab_size,
                "max_token_id": self.max_id, **extra}
        try:
            self.tmp_meta.write_text(json.dumps(meta, indent=1))
            self.tmp_meta.replace(self.path.with_suffix(".json"))
            self.tmp_bin.replace(self.path)
        finally:
            self.abort()
        return self.path

    def abort(self) -> None:
        self._file.close()
        self.tmp_bin.unlink(missing_ok=True)
        self.tmp_meta.unlink(missing_ok=True)
