"""safetensors writers: plait's streaming writer against the safetensors library's save_file.

    python benchmarks/safetensors_writer.py [--tensors 8] [--mb 32]
        [--write docs/results/safetensors_writer.md]

A synthetic model of `--tensors` fp32 tensors of `--mb` MB each, each made only when a
writer asks for it (as an export reads one tensor at a time from a checkpoint), written
as one file by: `stream` (plait/checkpoint/export.py `write_safetensors`: header first,
then one tensor in memory at a time), `library` (safetensors.torch.save_file of the whole
state dict: what one file through the library needs), and `library, shards` (save_file
per shard of at most two tensors: what `plait export --to hf:` does, bounded by its shard
size). Each writer runs in a fresh process; the peak is the process's resident-memory
high-water mark less its resident memory before writing. The files are checked to hold
the same tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402

WRITERS = ("stream", "library", "library, shards")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _one(writer: str, out: Path, tensors: int, mb: int) -> dict:
    """Write the model with `writer` in this process; the peak and the seconds."""
    import torch
    from safetensors.torch import save_file

    from plait.checkpoint.export import write_safetensors

    n = mb * 2**20 // 4
    shapes = {f"t{i}": (n // 256, 256) for i in range(tensors)}

    def load(name: str) -> torch.Tensor:
        return torch.full(shapes[name], float(int(name[1:]) + 1))

    before = _rss_mb()
    start = time.perf_counter()
    if writer == "stream":
        write_safetensors(out, shapes, load, "fp32", {"format": "pt"})
    elif writer == "library":
        save_file({name: load(name) for name in shapes}, str(out), {"format": "pt"})
    else:
        names = list(shapes)
        for i in range(0, len(names), 2):
            save_file({name: load(name) for name in names[i:i + 2]},
                      str(out.with_name(f"{out.stem}-{i // 2}.safetensors")), {"format": "pt"})
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "peak_mb": peak - before}


def _check(tmp: Path, tensors: int) -> None:
    from safetensors.torch import load_file

    stream, library = load_file(tmp / "stream.safetensors"), load_file(tmp / "library.safetensors")
    assert stream.keys() == library.keys() and len(stream) == tensors
    assert all(bool((stream[k] == library[k]).all()) for k in stream)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--one", choices=WRITERS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    results.add_write_flag(p)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, Path(args.out), args.tensors, args.mb)))
        return
    load0, rows = os.getloadavg()[0], []
    with tempfile.TemporaryDirectory(prefix="plait-st-bench-") as d:
        tmp = Path(d)
        for writer in WRITERS:
            out = tmp / f"{writer.split(',')[0]}.safetensors"
            cmd = [sys.executable, __file__, "--one", writer, "--out", str(out),
                   "--tensors", str(args.tensors), "--mb", str(args.mb)]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                            env=env).stdout.strip().splitlines()[-1])
            print(f"{writer:<16} {got['seconds']:7.2f} s  peak +{got['peak_mb']:7.0f} MB")
            rows.append((writer, f"{got['seconds']:.2f} s", f"{got['peak_mb']:.0f} MB"))
        _check(tmp, args.tensors)
    if args.write:
        total = args.tensors * args.mb
        results.write(
            args.write, "safetensors: plait's streaming writer against the library", [
                f"One file of {args.tensors} fp32 tensors of {args.mb} MB ({total} MB), each "
                "made when the writer asks for it; each writer in a fresh process:\n\n"
                + results.table(("writer", "time", "peak memory above the start"), rows)],
            "the library's `save_file` takes the whole state dict, so one file through it "
            "holds the whole model in memory; the streaming writer about two tensors (the "
            "one made and the one written). Per shard the library holds one shard, which is "
            "why `plait export --to hf:` writes shards through the library, and `plait "
            "checkpoint consolidate` (one file of any size) streams. Times are alike.",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
