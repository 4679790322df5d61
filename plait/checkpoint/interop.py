"""`plait export --from CHECKPOINT|hf:DIR|dcp:DIR --to hf:OUT|dcp:OUT [--dtype fp32|bf16]
[--dcp-names 2026|2025]`: a model for the rest of the ecosystem (docs/interop.md).

`hf:OUT` is a directory `transformers` loads (plait/checkpoint/hf_export.py); `dcp:OUT` a
torch.distributed.checkpoint directory with torchtitan's names, today's or its 2025 ones
(plait/checkpoint/dcp_export.py). Either is built under a temporary name beside OUT and
renamed into place: a failed export leaves nothing. An OUT that holds files is refused
unless `--force`, which replaces it whole once the new one is complete; OUT never lies
inside the source, nor holds it. Everything is checked before anything is read or written.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from . import dcp, hf
from .export import DTYPES
from .format import CheckpointError
from .source import Source
from .titan_names import DEFAULT_NAMING, NAMINGS

EXPORT_DTYPES = ("fp32", "bf16")


def _out_dir(target: str) -> tuple[str, Path]:
    """(kind, directory) of `--to hf:OUT|dcp:OUT`."""
    for kind, directory in (("hf", hf.hf_dir(target)), ("dcp", dcp.dcp_dir(target))):
        if directory is not None:
            return kind, directory
    raise CheckpointError(f"--to {target}: name the output as hf:DIR (transformers) or "
                          "dcp:DIR (torch.distributed.checkpoint, torchtitan's names)")


def _source_dir(source: str) -> Path:
    """The directory or file `--from` reads."""
    return hf.hf_dir(source) or dcp.dcp_dir(source) or Path(source)


def _overlap_problem(kind: str, out: Path, source: str) -> str | None:
    """OUT inside the source would write into it; OUT holding it would delete it."""
    mine, theirs = out.expanduser().resolve(), _source_dir(source).expanduser().resolve()
    if mine.is_relative_to(theirs):
        return (f"--to {kind}:{out} is inside --from {source}, which this export reads; "
                "choose a directory outside it")
    if theirs.is_relative_to(mine):
        return (f"--to {kind}:{out} holds --from {source}, which this export reads; "
                "choose another directory")
    return None


def export_problems(target: str, dtype: str, source: str | None = None,
                    force: bool = False, dcp_names: str | None = None) -> list[str]:
    """The output's problems, before anything is read or written."""
    try:
        kind, out = _out_dir(target)
    except CheckpointError as e:
        return [str(e)]
    problems = [] if dtype in EXPORT_DTYPES and dtype in DTYPES else [
        f"--dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}"]
    if dcp_names is not None and dcp_names not in NAMINGS:
        problems.append(f"--dcp-names {dcp_names}: choose one of {', '.join(NAMINGS)}")
    elif dcp_names is not None and kind != "dcp":
        problems.append(f"--dcp-names {dcp_names}: names torchtitan's tensors, for --to "
                        "dcp:OUT only; leave it out for --to hf:")
    overlap = _overlap_problem(kind, out, source) if source else None
    if overlap:
        problems.append(overlap)
    elif out.exists() and not out.is_dir():
        problems.append(f"--to {kind}:{out} exists and is a file, not an empty "
                        "directory; name a directory to create")
    elif out.is_dir() and any(out.iterdir()) and not force:
        problems.append(f"--to {kind}:{out} exists and is not an empty directory; pass "
                        "--force to replace it, or choose a new directory")
    parent = next((p for p in out.parents if p.exists()), Path("."))
    if not parent.is_dir():
        problems.append(f"--to {kind}:{out}: {parent} is a file, not a directory")
    elif not os.access(parent, os.W_OK | os.X_OK):
        problems.append(f"--to {kind}:{out}: {parent} is not writable")
    return problems


def export(source: str, target: str, dtype: str = "fp32", force: bool = False,
           dcp_names: str | None = None) -> tuple[Path, int]:
    """Write `source` (a checkpoint, hf:DIR or dcp:DIR) as `target` (hf:OUT or dcp:OUT,
    the latter in torchtitan's `dcp_names`, default today's; with `force`, one that holds
    files is replaced); returns (OUT, tensors written)."""
    problems = export_problems(target, dtype, source, force, dcp_names)
    if problems:
        raise CheckpointError("; ".join(problems))
    kind, out = _out_dir(target)
    src = Source(source)
    if kind == "dcp":
        from .dcp_export import write_dcp

        naming = dcp_names or DEFAULT_NAMING
        return out, into_new_dir(out, lambda tmp: write_dcp(src, tmp, dtype, naming))
    from .hf_export import write_hf
    return out, into_new_dir(out, lambda tmp: write_hf(src, tmp, dtype))


def into_new_dir(out: Path, fill: Callable[[Path], int]) -> int:
    """`fill(tmp)` a temporary directory beside `out`, then rename it to `out`; an `out`
    that holds files (checked: the user passed --force) is moved aside first and removed
    only after, so the old model stays whole until the new one is. Nothing is left
    behind on failure. Returns what `fill` returns."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp, old = out.with_name(f".{out.name}.{tag}.tmp"), out.with_name(f".{out.name}.{tag}.old")
    tmp.mkdir()
    try:
        n = fill(tmp)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # empty: the rename takes its place
        elif out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    if old.exists():
        shutil.rmtree(old)
    return n
