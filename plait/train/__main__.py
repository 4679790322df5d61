"""One rank of a training job: `torchrun --nproc-per-node N -m plait.train [train flags]`.

Takes the same flags as `plait train` (without --nproc). Reads the launcher's RANK,
WORLD_SIZE (this is the CLI layer), validates, builds the mesh, trains; rank 0 shows
progress, writes the metrics file and prints the summary. Any exception exits non-zero
with its traceback, so the launcher brings the whole job down.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from plait.cli import add_train_args, config_from_args, resolve_data
from plait.mesh import ParallelMesh
from plait.train.data import GlobalBatches, TokenFile
from plait.train.loop import train
from plait.train.report import print_summary, progress_reporter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.train")
    add_train_args(parser)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = config_from_args(args).check(world_size=world)
    data = resolve_data(cfg, args.data_dir) if rank == 0 or cfg.train.data else None
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    if data is None:  # non-zero ranks wait for rank 0 to prepare the default corpus
        dist.barrier()
        data = resolve_data(cfg, args.data_dir)
    elif world > 1 and not cfg.train.data:
        dist.barrier()
    mesh = ParallelMesh.build(cfg.parallel)
    batches = GlobalBatches(TokenFile.open(data), cfg.train.seq_len, cfg.train.global_batch,
                            cfg.train.seed, cfg.model.vocab_size)
    lead = rank == 0
    metrics_file = open(args.metrics_out, "w") if lead and args.metrics_out else None  # noqa: SIM115
    try:
        with progress_reporter(cfg.train.steps, enabled=lead and not args.quiet) as show:
            def on_step(row: dict) -> None:
                show(row)
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()

            result = train(cfg, mesh, batches, on_step=on_step)
        if metrics_file:
            metrics_file.write(json.dumps(result.summary) + "\n")
        if lead and not args.quiet:
            print_summary(result.summary, result.metrics)
    finally:
        if metrics_file:
            metrics_file.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
