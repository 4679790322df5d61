"""`plait data prepare`: text files -> byte-level BPE tokenizer -> token file.

The embedded default corpus is the Python standard library's own source, present on
every machine with Python: the first files in sorted path order up to a byte budget
(so it depends only on the Python version). The tokenizer is a byte-level BPE trained
locally with the `tokenizers` package, or the user's own tokenizer file.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from plait.train.data import DataError, write_token_file

DEFAULT_VOCAB = 2048
DEFAULT_BYTES = 3 * 2**20
END_OF_TEXT = "<|endoftext|>"


def default_data_dir() -> Path:
    return Path.home() / ".cache" / "plait" / "default-corpus"


def default_token_file(data_dir: Path | None = None) -> Path:
    return (data_dir or default_data_dir()) / "tokens.bin"


def stdlib_files(max_bytes: int = DEFAULT_BYTES) -> list[Path]:
    """Standard-library .py files (tests and site-packages excluded), sorted, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    picked, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        picked.append(path)
        total += size
    if not picked:
        raise DataError(f"no standard-library sources found under {root}; pass text files")
    return picked


def train_tokenizer(files: list[Path], vocab_size: int):
    """A byte-level BPE tokenizer trained on `files` (every byte representable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(f) for f in files], trainer)
    return tok


def prepare(out: Path, files: list[Path] | None = None, tokenizer_file: Path | None = None,
            vocab_size: int = DEFAULT_VOCAB, max_bytes: int = DEFAULT_BYTES) -> Path:
    """Tokenize `files` (default: the stdlib corpus) into `out` (.bin + .json + tokenizer)."""
    from tokenizers import Tokenizer

    source = "user" if files else "stdlib"
    files = [Path(f) for f in files] if files else stdlib_files(max_bytes)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DataError(f"text files not found: {', '.join(missing[:5])}")
    if tokenizer_file is not None:
        if not Path(tokenizer_file).is_file():
            raise DataError(f"tokenizer file {tokenizer_file} not found")
        tok = Tokenizer.from_file(str(tokenizer_file))
    else:
        tok = train_tokenizer(files, vocab_size)
    eot = tok.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        if eot is not None:
            ids.append(eot)
    out = Path(out).with_suffix(".bin")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok_path = out.with_suffix(".tokenizer.json")
    tmp = tok_path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(tok_path)
    return write_token_file(out, np.asarray(ids, dtype=np.int64), tok.get_vocab_size(),
                            {"tokenizer": tok_path.name, "files": len(files), "source": source})
