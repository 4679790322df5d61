"""`--compile` and `--async-tp` on this CPU: each against the same run without it.

    python benchmarks/speedups_cpu.py [--model tiny] [--steps 4] [--seq-len 32]
        [--write docs/results/speedups.md]

The defaults are the parity suite's settings (tests/helpers.py: vocabulary 256, global
batch 8, warm-up 1 step, clipping at 0.5), so that its tolerance classes apply.

Compile: for each named layout (gloo ranks, one thread each) the eager run and the run
with every block compiled by inductor (one inductor cache for the whole run, empty at
its start: the first layout compiles cold, later ones reuse what they share): the compiled run's
first step beyond the eager one's (compilation), the mean step time of the steps after
the first, and parity of the compiled run against the eager one (`assert_parity` at the
layout's tolerance class, the eager run as the reference).
Async TP: tp + SP layouts plain and with `--async-tp`: the mean step time, rank 0's tp
communication per step from issue to completion, its exposed part (the rank waited) and
hidden part (the ledger's overlap figures, as `plait train` prints them), the tp bytes
per step (equal by construction), the loss gap to plain and parity of each with the
single-process run (at the tp tolerance class).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import results
from common import batches

from plait.config import load_config
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.testing import assert_parity, merge_ranks
from plait.throughput import mean_step_time
from plait.train.data import synthetic_token_file
from plait.train.loop import TrainOptions, full_state, train

COMPILE_LAYOUTS = {
    "1 rank": ((), "fp32"),
    "dp2 zero-3": (("parallel.dp=2", "parallel.zero=3"), "fp32"),
    "tp2 + SP": (("parallel.tp=2", "parallel.sp=true"), "fp32-tp"),
    "pp2 1f1b": (("parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4"),
                 "fp32"),
}
ASYNC_LAYOUTS = {
    "tp2 + SP": ("parallel.tp=2", "parallel.sp=true"),
    "tp4 + SP": ("parallel.tp=4", "parallel.sp=true"),
    "dp2 x tp2 + SP": ("parallel.dp=2", "parallel.tp=2", "parallel.sp=true"),
}


def _cfg(args, sets):
    cfg = load_config(overrides={"model_name": args.model}, sets=[
        f"train.steps={args.steps}", f"train.global_batch={args.batch}",
        f"train.seq_len={args.seq_len}", f"model.vocab_size={args.vocab}",
        "train.warmup_steps=1", "train.grad_clip=0.5", *sets])
    return cfg.check(cfg.parallel.world_size)


def _rank(rank, world, args, sets, path):
    cfg = _cfg(args, sets)
    mesh = ParallelMesh.build(cfg.parallel)
    res = train(cfg, mesh, batches(cfg, path), TrainOptions(capture_first_grads=True))
    times = [m["step_time"] for m in res.metrics]
    tp = [mesh.ledger.overlap_by_dim(s).get("tp", {}) for s in range(1, cfg.train.steps)]
    per_step = {k: sum(r.get(k, 0.0) for r in tp) / len(tp)
                for k in ("seconds", "exposed", "hidden")}
    sent = [sum(r.sent for r in mesh.ledger.for_step(s) if r.dim == "tp")
            for s in range(1, cfg.train.steps)]
    return {"losses": res.losses, "grad_norms": [m["grad_norm"] for m in res.metrics],
            "first_grads": res.first_grads,
            "params": full_state(res.model, res.optimizer, mesh, res.placements),
            "first": times[0], "step": mean_step_time(times), "tp": per_step,
            "tp_sent": sum(sent) / len(sent)}


def _run(args, sets, path):
    world = _cfg(args, sets).parallel.world_size
    t0 = time.perf_counter()
    outs = run_ranks(_rank, world, args, list(sets), path)
    return merge_ranks(outs) | {"rank0": outs[0], "wall": time.perf_counter() - t0}


def _verdict(run, ref, tol) -> str:
    try:
        assert_parity(run, SimpleNamespace(**ref), tol)
        return "ok"
    except AssertionError as e:
        return f"FAIL: {str(e).splitlines()[0][:120]}"


def _loss_gap(a, b) -> str:
    return f"{max(abs(x - y) / abs(y) for x, y in zip(a['losses'], b['losses'], strict=True)):.1e}"


def _reference(args, path) -> dict:
    from plait.train.reference import reference_run

    cfg = _cfg(args, ())
    return vars(reference_run(cfg, batches(cfg, path)))


def compile_rows(args, path) -> list[tuple]:
    ref, rows = _reference(args, path), []
    for name, (sets, tol) in COMPILE_LAYOUTS.items():
        eager = _run(args, sets, path)
        compiled = _run(args, (*sets, "train.compile=true"), path)
        e, c = eager["rank0"], compiled["rank0"]
        rows.append((name, f"{c['first'] - e['first']:.1f}", f"{e['step'] * 1e3:.1f}",
                     f"{c['step'] * 1e3:.1f}", f"{e['step'] / c['step']:.2f}",
                     _loss_gap(compiled, eager), _verdict(eager, ref, tol),
                     _verdict(compiled, ref, tol)))
        print(" | ".join(rows[-1]), flush=True)
    return rows


def async_rows(args, path) -> list[tuple]:
    ref, rows = _reference(args, path), []
    for name, sets in ASYNC_LAYOUTS.items():
        runs = {label: _run(args, (*sets, *extra), path)
                for label, extra in (("plain", ()), ("async", ("parallel.async_tp=true",)))}
        for label, run in runs.items():
            r = run["rank0"]
            rows.append((name if label == "plain" else "", label, f"{r['step'] * 1e3:.1f}",
                         f"{r['tp']['seconds'] * 1e3:.1f}", f"{r['tp']['exposed'] * 1e3:.1f}",
                         f"{r['tp']['hidden'] * 1e3:.1f}", f"{r['tp_sent'] / 2**20:.2f}",
                         _loss_gap(run, runs["plain"]), _verdict(run, ref, "fp32-tp")))
            print(" | ".join(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--only", choices=("compile", "async-tp"))
    results.add_write_flag(p)
    args = p.parse_args()
    load0, sections = os.getloadavg()[0], []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # cold: timed
        # the parity suite's token file (tests/helpers.py), its tolerances' own data
        path = synthetic_token_file(Path(tmp) / "t.bin", 60_000, args.vocab, seed=7)
        head = (f"Model {args.model}, seq {args.seq_len}, global batch {args.batch}, "
                f"{args.steps} "
                "steps; gloo ranks on CPU, one thread each; step times are rank 0's mean "
                "over the steps after the first")
        if args.only != "async-tp":
            sections.append(f"{head}. Compile (inductor; one cache, empty at the start):"
                            "\n\n" + results.table(
                ("layout", "compile s", "eager ms", "compiled ms", "speed-up",
                 "loss gap vs eager", "eager vs 1 process", "compiled vs 1 process"),
                compile_rows(args, path)))
        if args.only != "compile":
            sections.append(f"{head}. Async TP, rank 0's tp communication per step:\n\n"
                            + results.table(("layout", "tp", "step ms", "tp comm ms",
                                             "exposed ms", "hidden ms", "tp sent MiB",
                                             "loss gap vs plain", "parity vs 1 process"),
                                            async_rows(args, path)))
    if args.write:
        results.write(
            args.write, "Compile and async tensor parallel on CPU", sections,
            "compile: the seconds the first compiled step adds (dynamo, AOTAutograd, "
            "inductor's code generation and the C++ build, per rank; the ranks build at "
            "once on the machine's cores), the step times eager and compiled and whether "
            "both runs stay within parity of the single-process run. On a CPU with a small "
            "model the fused element-wise kernels save little and the graph breaks at "
            "each collective cost their guards; a GPU's kernel launches are what fusion "
            "saves (`make gpu-check`'s compile section measures it). Async TP: the same "
            "bytes, with the tp communication's time from issue to completion split into "
            "what the rank waited for and what the partial matmuls hid; on gloo the hops "
            "share the cores with the matmuls, so the step time says little of a GPU's, "
            "where the copy engines and NVLink run beside the SMs.",
            run=results.run_line(load0))


if __name__ == "__main__":
    main()
