"""`plait checkpoint inspect` and `consolidate`: read a checkpoint without any process group;
and the safetensors writers.

`write_shards` (what `plait export --to hf:` uses) writes through the safetensors library
(`save_file`), one shard at a time, named and indexed as Hugging Face shards them
(`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`; one file,
`model.safetensors`, when it fits in one shard). `save_file` takes a whole state dict, so
its peak memory is the shard's bytes (measured: docs/results/safetensors_writer.md).

`write_safetensors` is what `consolidate` uses: one file of any size, streamed: header
first, then one tensor in memory at a time (the library would hold the whole model). The
format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian
header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end)},
"__metadata__": {...}} padded with spaces to a multiple of 8, then the tensors' raw
little-endian bytes, back to back in header order. Its files are read back by the
library (tests/test_checkpoint.py), as every reader here does.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from plait.files import atomic_output, give_usual_mode

from .format import (
    CheckpointError,
    CorruptCheckpoint,
    VerifiedFile,
    checkpoints,
    read_metadata,
)
from .reader import candidates, full_tensor

DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16"),
          "fp16": (torch.float16, "F16")}


def resolve(source: Path) -> Path:
    """A checkpoint directory, or the newest committed one under a root."""
    paths, _ = candidates(source)
    return paths[0]


def verify(path: Path, meta: dict) -> list[str]:
    """Every file's size and every block's checksum; the problems found."""
    problems = []
    for name, entry in meta["files"].items():
        try:
            VerifiedFile(path / name, entry).verify_all()
        except CorruptCheckpoint as e:
            problems.append(str(e))
    return problems


def inspect_text(source: Path, check: bool = True) -> str:
    """What `plait checkpoint inspect` prints (see `inspect_checkpoint`)."""
    return inspect_checkpoint(source, check)[0]


def inspect_checkpoint(source: Path, check: bool = True) -> tuple[str, bool]:
    """What `plait checkpoint inspect` prints: the checkpoints under a root, then the
    chosen one's step, layout, tensors, bytes per rank and whether it is complete; and
    whether it is sound (False: a checksum or size does not match)."""
    source = Path(source)
    lines = []
    listing = checkpoints(source)
    if listing:
        lines.append(f"{source}: {len(listing)} checkpoint(s)")
        lines += [f"  step {s:>8}  {'committed' if ok else 'INCOMPLETE (no marker)'}  {p.name}"
                  for s, p, ok in listing]
    try:
        path = resolve(source)
    except CheckpointError as e:
        if not listing:
            raise
        raise CheckpointError("\n".join([*lines, str(e)])) from e
    meta = read_metadata(path)
    problems = verify(path, meta) if check else []
    status = ("complete, every checksum verified" if check and not problems
              else "complete (marker), checksums not verified" if not problems
              else "CORRUPT: " + "; ".join(problems))
    lay, opt = meta["layout"], meta["optimizer"]
    total = sum(f["bytes"] for f in meta["files"].values())
    lines += [f"checkpoint {path}", f"  step        {meta['step']}",
              f"  status      {status}",
              f"  layout      {lay['describe']}; zero {lay['zero']}, schedule "
              f"{lay['schedule']}, sp {lay['sp']}, {lay['precision']}",
              f"  optimizer   {opt['kind']} (step count {opt['steps']}), states "
              f"{', '.join(opt['states'])}",
              f"  written by  plait {meta['plait_version']}, torch {meta['torch_version']}, "
              f"{meta['created']}",
              f"  bytes       {total:,} in {len(meta['files'])} file(s)"]
    lines += [f"    rank {f['rank']:>4}  {f['bytes']:>14,}  {name}"
              for name, f in sorted(meta["files"].items())]
    n_params = sum(math.prod(t["shape"]) for t in meta["tensors"].values()
                   if t.get("kind") != "buffer")
    lines.append(f"  tensors     {len(meta['tensors'])} ({n_params:,} parameters), global "
                 "shapes:")
    lines += [f"    {name:<34} {'x'.join(map(str, t['shape']))}"
              for name, t in meta["tensors"].items()]
    return "\n".join(lines), not problems


def consolidate(source: Path, out: Path, dtype: str = "fp32") -> tuple[Path, int]:
    """The full model (the fp32 masters, cast to `dtype`) as one safetensors file;
    returns (its path, tensors written). Writes `out` via a temporary name."""
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    path = resolve(Path(source))
    meta = read_metadata(path)
    files = {name: VerifiedFile(path / name, e) for name, e in meta["files"].items()}
    for f in files.values():
        f.check_size()
    names = sorted(meta["tensors"])
    shapes = {n: tuple(meta["tensors"][n]["shape"]) for n in names}
    out = write_safetensors(Path(out), shapes, lambda n: torch.from_numpy(
        full_tensor(path, meta, n, files=files)), dtype,
        {"format": "pt", "plait_step": str(meta["step"]), "plait_checkpoint": str(path)})
    return out, len(names)


def write_safetensors(out: Path, shapes: dict[str, tuple[int, ...]],
                      load: Callable[[str], torch.Tensor], dtype: str,
                      metadata: dict[str, str]) -> Path:
    """Tensors `shapes` (name -> shape, in file order) as one safetensors file, each got
    from `load(name)` and cast to `dtype`, one in memory at a time; via a temporary name."""
    tdtype, code = DTYPES[dtype]
    width = torch.empty(0, dtype=tdtype, device="cpu").element_size()
    header, offset = {}, 0
    for n, shape in shapes.items():
        size = math.prod(shape) * width
        header[n] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_output(out) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for n, shape in shapes.items():
            t = load(n).to(tdtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{n}: got shape {tuple(t.shape)}, expected {shape}")
            f.write(memoryview(t.view(torch.uint8).numpy()))
    return out


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, by the library (for tests and for checking an
    export)."""
    from safetensors.torch import load_file

    return load_file(str(path))


SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default (max_shard_size "5GB")


def write_shards(out: Path, shapes: dict[str, tuple[int, ...]],
                 load: Callable[[str], torch.Tensor], dtype: str, metadata: dict[str, str],
                 shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Tensors `shapes` (name -> shape, in file order), each from `load(name)` cast to
    `dtype`, as safetensors shards of at most `shard_bytes` (a larger tensor alone) in the
    directory `out`, through the library; returns the files written."""
    from safetensors.torch import save_file

    tdtype = DTYPES[dtype][0]
    width = torch.empty(0, dtype=tdtype, device="cpu").element_size()
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * width
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    for file, names in zip(files, groups, strict=True):
        tensors = {}
        for name in names:
            t = load(name).to(tdtype).contiguous()
            if tuple(t.shape) != tuple(shapes[name]):
                raise CheckpointError(f"{name}: got shape {tuple(t.shape)}, expected "
                                      f"{shapes[name]}")
            tensors[name] = t
        save_file(tensors, str(out / file), metadata)
        give_usual_mode(out / file)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(math.prod(s) * width for s in shapes.values())},
                 "weight_map": {n: f for f, names in zip(files, groups, strict=True)
                                for n in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [out / f for f in files]
