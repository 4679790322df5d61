"""`plait data prepare`: documents -> byte-level BPE tokenizer -> token file.

The embedded default corpus is the Python standard library's own source, present on
every machine with Python: the first files in sorted path order up to a byte budget
(so it depends only on the Python version). The tokenizer is a byte-level BPE trained
locally with the `tokenizers` package, the user's own tokenizer file, or a Hugging Face
model's (`--tokenizer hf:DIR`: DIR/tokenizer.json, the model's end-of-sequence token
between documents). Inputs are text files, .jsonl or .parquet (plait/train/documents.py),
tokenized one document at a time and streamed to the token file.
"""

from __future__ import annotations

import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

from plait.files import artifact_problems, atomic_output
from plait.train.data import DataError
from plait.train.documents import STRUCTURED, TokenWriter, documents, structured_problem

DEFAULT_VOCAB = 2048
DEFAULT_BYTES = 3 * 2**20
END_OF_TEXT = "<|endoftext|>"
PROGRESS_EVERY_S = 2.0
BATCH_DOCS, BATCH_CHARS = 256, 1 << 23  # documents held at once: at most this many, ~8 MB


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


def train_tokenizer(files: list[Path], vocab_size: int, text_field: str = "text"):
    """A byte-level BPE tokenizer trained on `files` (every byte representable): on the
    text files as files, on .jsonl / .parquet inputs' documents, streamed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    if any(Path(f).suffix in STRUCTURED for f in files):
        tok.train_from_iterator((d for f in files for d in documents(f, text_field)), trainer)
    else:
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


def hf_tokenizer(directory: Path) -> tuple[Path, int | None, int | None]:
    """A Hugging Face model directory's tokenizer.json, its end-of-document id (config.json's
    eos_token_id, else tokenizer_config.json's eos_token) and the model's vocabulary."""
    import json

    def read(name: str) -> dict:
        try:
            data = json.loads((directory / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    config, tok_config = read("config.json"), read("tokenizer_config.json")
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        token = tok_config.get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        eos = None
        if isinstance(token, str) and (directory / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            eos = Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(token)
    vocab = config.get("vocab_size")
    return directory / "tokenizer.json", eos, vocab if isinstance(vocab, int) else None


def hf_tokenizer_problems(directory: Path) -> list[str]:
    """--tokenizer hf:DIR: the tokenizer is there and fits the model's vocabulary."""
    from tokenizers import Tokenizer

    if not directory.is_dir():
        return [f"--tokenizer hf:{directory}: no such directory"]
    path, _, vocab = hf_tokenizer(directory)
    if not path.is_file():
        return [f"--tokenizer hf:{directory}: no tokenizer.json in it (plait reads the "
                "tokenizers library's JSON format)"]
    problem = _tokenizer_problem(path)
    if problem:
        return [problem]
    size = Tokenizer.from_file(str(path)).get_vocab_size()
    if vocab is not None and size > vocab:
        return [f"--tokenizer hf:{directory}: the tokenizer has {size} tokens, more than the "
                f"model's vocab_size {vocab} (config.json); use the model's own tokenizer"]
    return []


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
                     vocab_size: int | None, text_field: str = "text",
                     hf_dir: Path | None = None, force: bool = False) -> list[str]:
    """Every problem with a `plait data prepare` request, each with its fix; nothing is
    written or trained. `hf_dir`: the tokenizer is that Hugging Face model's. `force`:
    existing outputs may be replaced."""
    problems = [p for p in (structured_problem(f, text_field) if f.suffix in STRUCTURED
                            else _text_problem(f) for f in files) if p]
    if hf_dir is not None:
        problems += hf_tokenizer_problems(hf_dir)
    elif tokenizer_file is not None:
        problems += [p for p in [_tokenizer_problem(tokenizer_file)] if p]
    if tokenizer_file is not None or hf_dir is not None:
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
    inputs = [*files, *([tokenizer_file] if tokenizer_file else []),
              *([hf_dir] if hf_dir else [])]
    for path in (bin_path, bin_path.with_suffix(".json"),
                 bin_path.with_suffix(".tokenizer.json")):
        problems += artifact_problems("--out", path, inputs, force)
    return problems


def prepare(out: Path, files: list[Path] | None = None, tokenizer_file: Path | None = None,
            vocab_size: int = DEFAULT_VOCAB, max_bytes: int = DEFAULT_BYTES,
            text_field: str = "text", eot_id: int | None = None,
            progress: Callable[[str], None] | None = None) -> Path:
    """Tokenize `files` (default: the stdlib corpus) into `out` (.bin + .json + tokenizer),
    one document at a time, the end-of-document token (`eot_id`, else the tokenizer's
    <|endoftext|> if it has one) after each. `progress(line)`: told every few seconds."""
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
        tok = train_tokenizer(files, vocab_size, text_field)
    eot = eot_id if eot_id is not None else tok.token_to_id(END_OF_TEXT)
    out = Path(out).with_suffix(".bin")
    writer = TokenWriter(out, tok.get_vocab_size())
    last, docs = time.monotonic(), 0
    try:
        pending: list[str] = []  # a bounded batch of documents: encoded in parallel

        def flush() -> None:
            for enc in tok.encode_batch(pending):
                writer.append(enc.ids + ([eot] if eot is not None else []))
            pending.clear()

        for i, f in enumerate(files):
            for doc in documents(f, text_field):
                pending.append(doc)
                docs += 1
                if len(pending) >= BATCH_DOCS or sum(map(len, pending)) > BATCH_CHARS:
                    flush()
                if progress is not None and time.monotonic() - last > PROGRESS_EVERY_S:
                    last = time.monotonic()
                    progress(f"{i + 1}/{len(files)} files, {docs:,} documents, "
                             f"{writer.count:,} tokens")
        flush()
        tok_path = out.with_suffix(".tokenizer.json")
        with atomic_output(tok_path) as tmp:
            tok.save(str(tmp))
        return writer.commit({"tokenizer": tok_path.name, "files": len(files),
                              "documents": docs, "source": source,
                              "end_of_document": eot})
    finally:
        writer.abort()
