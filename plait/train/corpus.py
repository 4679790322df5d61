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

from plait.files import atomic_output, output_problems
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


MIN_VOCAB = 257  # the 256 byte tokens of byte-level BPE and the end-of-text token
MAX_VOCAB = 1 << 32  # token ids are stored as uint32 at most


def _text_problem(path: Path) -> str | None:
    """Why `path` cannot be read as UTF-8 text, or None."""
    if not path.is_file():
        return f"text file {path} {'is a directory' if path.is_dir() else 'not found'}"
    try:
        raw = path.read_bytes()
    except OSError as e:
        return f"text file {path} cannot be read ({e.strerror})"
    if b"\0" in raw[:1 << 16]:
        return f"{path} is a binary file, not text; pass text files"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{path} is not UTF-8 text (byte {e.start}); convert it to UTF-8 first"
    return None


def _tokenizer_problem(path: Path) -> str | None:
    from tokenizers import Tokenizer

    if not path.is_file():
        return f"--tokenizer {path} {'is a directory' if path.is_dir() else 'not found'}"
    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own untyped errors
        return (f"--tokenizer {path} is not a tokenizers JSON file ({str(e)[:120]}); give a "
                "tokenizer.json saved by the `tokenizers` library")
    return None


def prepare_problems(out: Path, files: list[Path], tokenizer_file: Path | None,
                     vocab_size: int | None) -> list[str]:
    """Every problem with a `plait data prepare` request, each with its fix; nothing is
    written or trained."""
    problems = [p for p in map(_text_problem, files) if p]
    if tokenizer_file is not None:
        problems += [p for p in [_tokenizer_problem(tokenizer_file)] if p]
        if vocab_size is not None:
            problems.append("--vocab-size trains a tokenizer, --tokenizer brings one; give "
                            "one of them")
    if vocab_size is not None and not MIN_VOCAB <= vocab_size < MAX_VOCAB:
        problems.append(f"--vocab-size {vocab_size} must be between {MIN_VOCAB} (the 256 "
                        f"bytes and end-of-text) and {MAX_VOCAB - 1}")
    if Path(out).is_dir():
        return [*problems, f"--out {out} is a directory; give a token file path inside it, "
                f"e.g. {Path(out) / 'tokens.bin'}"]
    bin_path = Path(out).with_suffix(".bin")
    inputs = [*files, *([tokenizer_file] if tokenizer_file else [])]
    for path in (bin_path, bin_path.with_suffix(".json"),
                 bin_path.with_suffix(".tokenizer.json")):
        problems += output_problems("--out", path, inputs)
    return problems


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
    with atomic_output(tok_path) as tmp:
        tok.save(str(tmp))
    return write_token_file(out, np.asarray(ids, dtype=np.int64), tok.get_vocab_size(),
                            {"tokenizer": tok_path.name, "files": len(files), "source": source})
