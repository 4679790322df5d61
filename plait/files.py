"""Output files that are never damaged: checked before any work, written whole or not at all.

Every output a command writes goes through here. `output_problems` checks a path before
a command starts (not a directory, its directory creatable and writable, neither an input
nor inside an input directory, through symlinks and `..`), so a bad path is refused with
the other bad inputs. `artifact_problems` adds the rule of the commands that write an
artifact (a model, a token file, a config, a profile, a plot): an existing file is
replaced only with `--force`. Metrics and traces use `output_problems` alone: a rerun
writes them again. `atomic_output`
hands out a temporary name in the same directory and renames it over the target only
when the block finishes: a reader sees the old file or the new one, never half of one.
`PartialFile` streams lines to `NAME.partial` and renames it to NAME when complete; on
failure the partial file stays, under that clearly named path.

Standard library only: every layer (the pipeline simulator included) may use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

PARTIAL_SUFFIX = ".partial"


def _nearest_existing(path: Path) -> Path:
    """The path itself or its closest ancestor that exists."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (hard links and symlinks included)."""
    a, b = Path(a), Path(b)
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def output_problems(flag: str, path: str | Path, inputs: Iterable[str | Path] = ()) -> list[str]:
    """What stops `path` from being written as the output of `flag`, each with its fix.

    Nothing is created: missing parent directories are made when the file is written."""
    text = str(path)
    if not text.strip():
        return [f"{flag} is empty; give a file path"]
    p = Path(text).expanduser()
    resolved = p.resolve()
    if p.is_dir():
        return [f"{flag} {text} is a directory; give a file path inside it, e.g. "
                f"{p / 'out'}"]
    base = _nearest_existing(resolved.parent)
    if not base.is_dir():
        return [f"{flag} {text}: {base} is a file, not a directory; choose another path"]
    if not os.access(base, os.W_OK | os.X_OK) or not _can_create_in(base):
        return [f"{flag} {text}: {base} is not writable; choose a directory you can write"]
    if p.exists() and not os.access(p, os.W_OK):
        return [f"{flag} {text} exists and is not writable; choose another path"]
    for source in inputs:
        if not source:
            continue
        source_resolved = Path(source).expanduser().resolve()
        if resolved == source_resolved or same_file(p, source):
            return [f"{flag} {text} is also an input of this command ({source}); writing it "
                    "would destroy that input: choose another path"]
        if resolved.is_relative_to(source_resolved):
            return [f"{flag} {text} is inside {source}, an input of this command; writing "
                    "there would damage that input: choose a path outside it"]
    return []


FORCE_HELP = "replace an existing output (by default plait refuses to)"


def artifact_problems(flag: str, path: str | Path, inputs: Iterable[str | Path] = (),
                      force: bool = False) -> list[str]:
    """`output_problems`, and an existing file refused unless `force`: an artifact is
    never replaced by accident. With `force` it is replaced whole (`atomic_output`)."""
    problems = output_problems(flag, path, inputs)
    p = Path(str(path)).expanduser()
    if not problems and not force and (p.exists() or p.is_symlink()):
        problems.append(f"{flag} {path} exists; plait does not replace an output unless "
                        "asked: pass --force to replace it, or choose another path")
    return problems


def directory_problems(flag: str, path: str | Path) -> list[str]:
    """What stops `path` from being an output directory of `flag` (it may exist, as a
    directory, or be creatable), each with its fix. Nothing is created."""
    text = str(path)
    if not text.strip():
        return [f"{flag} is empty; give a directory path"]
    p = Path(text).expanduser()
    if p.exists() and not p.is_dir():
        return [f"{flag} {text} is a file, not a directory; give a directory path"]
    base = _nearest_existing(p.resolve())
    if not base.is_dir():
        return [f"{flag} {text}: {base} is a file, not a directory; choose another path"]
    if not os.access(base, os.W_OK | os.X_OK) or not _can_create_in(base):
        return [f"{flag} {text}: {base} is not writable; choose a directory you can write"]
    return []


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be created there (and at once removed): permission bits do not
    tell for root, a read-only or special filesystem (/proc, /sys)."""
    probe = directory / f".plait-probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        probe.open("x").close()
    except OSError:
        return False
    probe.unlink(missing_ok=True)
    return True


def temp_name(path: Path) -> Path:
    """A unique temporary name beside `path` (same directory, so the rename is atomic),
    ending in the same suffix (writers such as matplotlib choose the format by it)."""
    return path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
                          f"{path.suffix}")


def write_png(fig, path: str | Path, dpi: int) -> Path:
    """A matplotlib figure saved as PNG at `path`, atomically (a failed draw never leaves
    half a file); the caller closes the figure."""
    path = Path(path)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    return path


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path; renamed to `path` when the block succeeds, removed if not.

    Parent directories are created."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(target)
    try:
        yield tmp
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    """The process's umask, read where the kernel shows it (setting it to read it would
    change it for other threads meanwhile)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_usual_mode(path: str | Path) -> None:
    """The mode a file created by `open` gets (0666 less the umask, e.g. 0644): writers
    that go through a private temporary file (safetensors' `save_file`) leave 0600."""
    os.chmod(path, 0o666 & ~_umask())


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` whole or not at all; returns the path written."""
    with atomic_output(path) as tmp:
        tmp.write_text(text)
    return Path(path).expanduser()


class PartialFile:
    """Lines streamed to `NAME.partial`; `finish()` renames it to NAME, `abandon()` keeps
    the partial file (and says where) so a failed run never replaces a complete one."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.partial = self.partial_of(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.partial, "w")  # noqa: SIM115 (kept open)

    @staticmethod
    def partial_of(path: str | Path) -> Path:
        """Where lines for `path` stream until it is complete."""
        path = Path(path).expanduser()
        return path.with_name(path.name + PARTIAL_SUFFIX)

    @staticmethod
    def rows_left(path: str | Path) -> list[dict]:
        """The JSON rows with a "step" that an earlier run left in NAME.partial (a stopped
        or killed run), else in NAME; a line cut short by a kill is skipped."""
        partial = PartialFile.partial_of(path)
        source = partial if partial.is_file() else Path(path).expanduser()
        rows = []
        with contextlib.suppress(OSError):
            for line in source.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    if isinstance(row, dict) and isinstance(row.get("step"), int):
                        rows.append(row)
        return rows

    def write_line(self, line: str) -> None:
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def finish(self) -> Path:
        """Complete: the partial file becomes NAME."""
        self._close()
        self.partial.replace(self.path)
        return self.path

    def abandon(self) -> Path:
        """Incomplete: the partial file stays as NAME.partial; NAME is untouched."""
        self._close()
        return self.partial

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
