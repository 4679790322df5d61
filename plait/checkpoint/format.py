"""The on-disk format: a directory per checkpoint, one data file per rank, one JSON index.

    D/step-00000008/         committed: it has COMMITTED, written last
      rank-00000.bin         raw little-endian fp32 chunks, back to back
      rank-00000.json        that rank's manifest (merged into metadata.json at commit)
      metadata.json          step, layout, config, tensors (global shapes), files, chunks
      COMMITTED              {"step", "metadata_crc32"}: the marker
    D/step-00000012.tmp-<token>/   being written (or abandoned): never loaded

A *chunk* is elements [start, stop) of the row-major flattening of a *box* (a rectangular
block `box_offset`/`box_shape`) of a tensor's global, unpadded shape: a tensor-parallel
slice is a box, a ZeRO flat shard a range of it, a whole replicated tensor the box that is
the tensor. Readers turn both what was saved and what they need into runs of the global
flat index (`global_runs`) and intersect them, so any layout reads any other's.
Every file is checksummed in blocks of BLOCK bytes (CRC-32, zlib): a reader verifies the
blocks it reads, and a truncated file is found by its size before anything is read.
Everything here is host-side (stdlib + numpy): metadata is readable without torch's
process group, or torch at all.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "plait-checkpoint/1"
BLOCK = 1 << 20  # bytes per checksummed block: reads verify whole blocks
MARKER, METADATA = "COMMITTED", "metadata.json"
# every saved state (masters and moments) is fp32, or float64 for a precision-fp64 run
# (a resumed oracle run continues from exactly its state); metadata names it per tensor
STATE_DTYPES = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}


def state_dtype(meta: dict, name: str) -> np.dtype:
    """The on-disk dtype of tensor `name`'s states (float32 where the metadata is silent)."""
    return STATE_DTYPES[meta["tensors"][name].get("dtype", "float32")]
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    """A checkpoint cannot be written or read; the message names the file and the fix."""


class CorruptCheckpoint(CheckpointError):
    """A file of a committed checkpoint is truncated or fails its checksum."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def is_committed(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def checkpoints(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, path, committed) of every `step-N` directory under `root`, newest first
    (temporary `step-N.tmp-*` directories are not checkpoints)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p, is_committed(p)))
    return sorted(out, key=lambda x: -x[0])


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: dict) -> bytes:
    """Write `obj` durably (write, flush, fsync); returns the bytes written."""
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


# ---- geometry: chunks as runs of the global flat index ----------------------------------
def global_runs(full_shape: tuple[int, ...], box_offset: tuple[int, ...],
                box_shape: tuple[int, ...], start: int, stop: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(global flat start, box flat start, length) of each contiguous run of elements
    [start, stop) of the box. Axes after the last one the box cuts are whole, so each
    index of the axes before it is one contiguous global run."""
    n = len(full_shape)
    cut = [i for i in range(n) if box_shape[i] != full_shape[i] or box_offset[i] != 0]
    if stop <= start:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    if not cut:  # the whole tensor: one run
        return (np.array([start], np.int64), np.array([start], np.int64),
                np.array([stop - start], np.int64))
    k = cut[-1]
    inner = math.prod(box_shape[k:])
    strides = [math.prod(full_shape[i + 1:]) for i in range(n)]
    outer = np.arange(start // inner, -(-stop // inner), dtype=np.int64)
    base = np.full(outer.shape, box_offset[k] * strides[k], dtype=np.int64)
    rem = outer.copy()
    for i in reversed(range(k)):  # unravel the outer index over the box's leading axes
        base += (box_offset[i] + rem % box_shape[i]) * strides[i]
        rem //= box_shape[i]
    lo = np.maximum(outer * inner, start)
    hi = np.minimum((outer + 1) * inner, stop)
    return base + (lo - outer * inner), lo, hi - lo


def intersect(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]
              ) -> list[tuple[int, int, int]]:
    """Overlaps of two sorted, disjoint run lists (global, local, length): (local in a,
    local in b, length) of each."""
    (ga, la, na), (gb, lb, nb) = a, b
    out, i, j = [], 0, 0
    while i < len(ga) and j < len(gb):
        lo = max(ga[i], gb[j])
        hi = min(ga[i] + na[i], gb[j] + nb[j])
        if lo < hi:
            out.append((int(la[i] + lo - ga[i]), int(lb[j] + lo - gb[j]), int(hi - lo)))
        if ga[i] + na[i] <= gb[j] + nb[j]:
            i += 1
        else:
            j += 1
    return out


# ---- writing and reading one rank's file -------------------------------------------------
class RankWriter:
    """Appends fp32 or float64 chunks to one rank's file, checksumming each BLOCK bytes."""

    def __init__(self, path: Path):
        self.path, self.f = path, open(path, "wb")  # noqa: SIM115 - closed by close()
        self.bytes, self.blocks = 0, []
        self._crc, self._in_block = 0, 0

    def write(self, data: np.ndarray) -> int:
        """Append `data` (fp32 or float64, little-endian); returns its byte offset."""
        offset = self.bytes
        if data.dtype not in STATE_DTYPES.values():
            raise TypeError(f"checkpoint states are float32 or float64, not {data.dtype}")
        mv = memoryview(np.ascontiguousarray(data)).cast("B")
        self.f.write(mv)
        self.bytes += len(mv)
        while len(mv):
            part = mv[:BLOCK - self._in_block]
            self._crc = zlib.crc32(part, self._crc)
            self._in_block += len(part)
            if self._in_block == BLOCK:
                self.blocks.append(self._crc)
                self._crc, self._in_block = 0, 0
            mv = mv[len(part):]
        return offset

    def close(self) -> dict:
        """Flush and fsync; the file's entry in the metadata."""
        if self._in_block:
            self.blocks.append(self._crc)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.bytes, "block_crc32": self.blocks}


@dataclass
class VerifiedFile:
    """Reads byte ranges of one data file, checking its size once and each block's
    CRC-32 the first time it is read."""

    path: Path
    entry: dict  # the file's metadata: bytes, block_crc32
    _ok: set[int] = field(default_factory=set)

    def check_size(self) -> None:
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise CorruptCheckpoint(f"{self.path}: missing ({e.strerror})") from e
        if size != self.entry["bytes"]:
            raise CorruptCheckpoint(f"{self.path}: {size} bytes, the metadata says "
                                    f"{self.entry['bytes']} (truncated or overwritten)")

    def read(self, lo: int, hi: int) -> memoryview:
        b0, b1 = lo // BLOCK, max(lo, hi - 1) // BLOCK
        with open(self.path, "rb") as f:
            f.seek(b0 * BLOCK)
            raw = f.read(min((b1 + 1) * BLOCK, self.entry["bytes"]) - b0 * BLOCK)
        mv = memoryview(raw)
        for b in range(b0, b1 + 1):
            if b in self._ok:
                continue
            block = mv[(b - b0) * BLOCK:(b - b0 + 1) * BLOCK]
            want = self.entry["block_crc32"][b] if b < len(self.entry["block_crc32"]) else None
            if zlib.crc32(block) != want:
                raise CorruptCheckpoint(
                    f"{self.path}: checksum mismatch in bytes {b * BLOCK}.."
                    f"{b * BLOCK + len(block)} (corrupted)")
            self._ok.add(b)
        return mv[lo - b0 * BLOCK:hi - b0 * BLOCK]

    def verify_all(self) -> None:
        self.check_size()
        if self.entry["bytes"]:
            self.read(0, self.entry["bytes"])


# ---- metadata ----------------------------------------------------------------------------
def read_metadata(path: Path) -> dict:
    """A committed checkpoint's metadata, checked against its marker. No process group."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not is_committed(path):
        raise CheckpointError(f"{path}: not committed (no {MARKER} marker): an interrupted "
                              "save; it is never loaded")
    try:
        marker = json.loads((path / MARKER).read_text())
        raw = (path / METADATA).read_bytes()
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{path / METADATA}: unreadable ({e})") from e
    if zlib.crc32(raw) != marker.get("metadata_crc32"):
        raise CorruptCheckpoint(f"{path / METADATA}: checksum does not match {MARKER}")
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, this plait reads "
                              f"{FORMAT!r}")
    return meta


def chunks_by_tensor(meta: dict) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for c in meta["chunks"]:
        out.setdefault((c["name"], c["state"]), []).append(c)
    return out


def check_coverage(meta: dict) -> None:
    """Every state of every tensor is saved exactly once: the chunks' runs of the global
    index are disjoint and add up to the tensor (a writer that saved a replica twice, or
    put a slice in the wrong place, fails the save instead of a later resume)."""
    by = chunks_by_tensor(meta)
    for name, t in meta["tensors"].items():
        shape, n = tuple(t["shape"]), math.prod(t["shape"])
        for state in t.get("states", meta["optimizer"]["states"]):
            runs = [global_runs(shape, tuple(c["box_offset"]), tuple(c["box_shape"]),
                                c["start"], c["stop"]) for c in by.get((name, state), [])]
            g = np.concatenate([r[0] for r in runs]) if runs else np.zeros(0, np.int64)
            k = np.concatenate([r[2] for r in runs]) if runs else np.zeros(0, np.int64)
            order = np.argsort(g, kind="stable")
            g, k = g[order], k[order]
            overlap = bool((g[:-1] + k[:-1] > g[1:]).any()) if len(g) > 1 else False
            if overlap or int(k.sum()) != n:
                raise CheckpointError(f"{name} {state}: the chunks hold {int(k.sum())} "
                                      f"elements{' (overlapping)' if overlap else ''}, the "
                                      f"tensor has {n} (a writer bug)")
