"""The GPU check's two-GPU sections (benchmarks/gpu_check.py): NCCL parity and peers.

`section_parity`: each layout on two ranks against the one-rank run of the same config on
the same device kind, by `plait.testing.assert_parity` at the tolerance class the CPU
suite uses for it (plait/testing.py PARITY_TOLERANCES, docs/parity.md): loss and grad
norm every step, first-step gradients, final parameters (bf16: each tensor's distance
relative to how far the reference moved it, from the shared initial weights).
`section_peers`: mean step time (first two steps left out) of plait's bucketed DP over
torch DDP and of plait's ZeRO-3 over torch FSDP2, two ranks, fp32, same weights and
batches. plait's step time is its device timer's (CUDA events); the peers' is the host
clock around a step that ends by reading the loss (a device sync).
On CPU (`--device cpu`) the same code runs on gloo ranks.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from plait.config import load_config
from plait.device import resolve_device
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.testing import assert_parity, merge_ranks
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file
from plait.train.loop import TrainOptions, full_state, train

# float64, the oracle's precision (docs/parity.md): the bounds follow from its epsilon, on
# a GPU's kernels as on a CPU's
PARITY_BASE = ("train.steps=4", "train.global_batch=8", "train.warmup_steps=1",
               "train.grad_clip=0.5", "model.vocab_size=4096", "train.precision=fp64")
# (label, settings, tolerance class): every layout on 2 ranks
LAYOUTS = (
    ("dp=2 bucketed", ("parallel.dp=2",), "fp64"),
    ("tp=2 + SP", ("parallel.tp=2", "parallel.sp=true"), "fp64"),
    ("pp=2 1f1b", ("parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4"),
     "fp64"),
    ("pp=2 zb-v", ("parallel.pp=2", "parallel.schedule=zb-v", "parallel.microbatches=4"),
     "fp64"),
    ("dp=2 ZeRO-3", ("parallel.dp=2", "parallel.zero=3"), "fp64"),
    ("dp=2 bf16", ("parallel.dp=2", "train.precision=bf16"), "bf16"),
)
PEER_STEPS = 8
WARMUP = 2


def _config(sets, world: int, smoke: bool):
    model = "tiny" if smoke else "small"
    seq = 32 if smoke else 128
    return load_config(overrides={"model_name": model}, sets=[
        *PARITY_BASE, f"train.seq_len={seq}", "model.n_layers=4", *sets]).check(world)


def _token_file(tmp: str | Path, vocab: int) -> Path:
    path = Path(tmp) / f"parity-{vocab}.bin"
    if not path.exists():
        synthetic_token_file(path, 200_000, vocab, seed=7)
    return path


def _batches(cfg, path) -> GlobalBatches:
    t = cfg.train
    return GlobalBatches(TokenFile.open(path), t.seq_len, t.global_batch, t.seed,
                         cfg.model.vocab_size)


def _cpu(d: dict | None) -> dict | None:
    return None if d is None else {n: t.detach().float().cpu() for n, t in d.items()}


def _parity_rank(rank: int, world: int, sets, smoke: bool, device_kind: str, path: str):
    cfg = _config(sets, world, smoke)
    device = resolve_device(device_kind, rank)
    mesh = ParallelMesh.build(cfg.parallel, device=device)
    result = train(cfg, mesh, _batches(cfg, path), TrainOptions(capture_first_grads=True))
    params = full_state(result.model, result.optimizer, mesh, result.placements)
    return {"losses": result.losses, "grad_norms": [m["grad_norm"] for m in result.metrics],
            "params": _cpu(params), "first_grads": _cpu(result.first_grads)}


def _backend(args) -> str:
    return "nccl" if args.device == "cuda" else "gloo"


def _one_rank(sets: tuple, args, path: Path) -> SimpleNamespace:
    """The one-rank run of the layout's settings (its parallel sizes dropped)."""
    kept = tuple(s for s in sets if not s.startswith("parallel."))
    out = run_ranks(_parity_rank, 1, kept, args.smoke, args.device, str(path),
                    timeout=args.section_timeout, backend=_backend(args))[0]
    return SimpleNamespace(**out, lr=_config(kept, 1, args.smoke).train.lr)


def _initial(sets: tuple, args) -> dict:
    from plait.model.transformer import build_model

    cfg = _config(tuple(s for s in sets if not s.startswith("parallel.")), 1, args.smoke)
    return {n: p.detach().clone() for n, p in build_model(cfg.model, seed=cfg.train.seed)
            .named_parameters()}


def section_parity(args, tmp: Path) -> list[dict]:
    path = _token_file(tmp, _config((), 1, args.smoke).model.vocab_size)
    refs: dict[tuple, SimpleNamespace] = {}
    rows = []
    for label, sets, tol in LAYOUTS:
        precision = tuple(s for s in sets if s.startswith("train."))
        if precision not in refs:
            refs[precision] = _one_rank(precision, args, path)
        ref = refs[precision]
        t0 = time.monotonic()
        outs = run_ranks(_parity_rank, 2, sets, args.smoke, args.device, str(path),
                         timeout=args.section_timeout, backend=_backend(args))
        run = merge_ranks(outs)
        gap = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref.losses, strict=True))
        try:
            assert_parity(run, ref, tol, init=_initial(sets, args) if tol == "bf16" else None)
            verdict = "ok"
        except AssertionError as e:
            verdict = f"FAIL: {str(e).splitlines()[0][:160]}"
        rows.append({"section": "parity", "check": f"{label} vs 1 {args.device} rank",
                     "measured": f"loss rel. gap {gap:.1e}",
                     "expected": f"class {tol} (loss rtol {_rtol(tol)})",
                     "result": f"{verdict} ({time.monotonic() - t0:.0f} s)"})
    return rows


def _rtol(tol: str) -> str:
    from plait.testing import PARITY_TOLERANCES

    return f"{PARITY_TOLERANCES[tol]['loss_rtol']:g}"


# ---- step time against torch's own ------------------------------------------------------

def _peer_config(args, world: int, *sets: str):
    model, seq = ("tiny", 32) if args.smoke else ("gpt3-1.3b", 1024)
    layers = 2 if args.smoke else 8
    return load_config(overrides={"model_name": model}, sets=[
        f"model.n_layers={layers}", "model.vocab_size=32000" if not args.smoke else
        "model.vocab_size=4096", f"train.seq_len={seq}", f"train.global_batch={4 * world}",
        f"parallel.dp={world}", f"train.steps={PEER_STEPS}", "parallel.microbatches=4",
        *sets]).check(world)


def _plait_peer(rank: int, world: int, args, path: str, zero: int):
    cfg = _peer_config(args, world, f"parallel.zero={zero}")
    mesh = ParallelMesh.build(cfg.parallel, device=resolve_device(args.device, rank))
    result = train(cfg, mesh, _batches(cfg, path))
    return [m["step_time"] for m in result.metrics]


def _torch_peer(rank: int, world: int, args, path: str, peer: str):
    import torch.distributed as dist
    from common import wrap_peer  # benchmarks/, on the path as the script's folder

    from plait.model.loss import microbatch_loss
    from plait.model.transformer import build_model

    cfg = _peer_config(args, world)
    device = resolve_device(args.device, rank).torch
    model = build_model(cfg.model, seed=cfg.train.seed).to(device)
    wrapped = wrap_peer(model, peer, cfg.parallel.bucket_mb)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    data, times = _batches(cfg, path), []
    per, mbs = cfg.train.global_batch // world, cfg.micro_batch_size()
    for step in range(PEER_STEPS):
        start = time.perf_counter()
        tokens = data.local_batch(step, rank, world).to(device)
        total = torch.zeros((), device=device)
        for mb in range(0, per, mbs):  # micro-batches accumulate, as plait's do
            loss = microbatch_loss(wrapped, tokens[mb:mb + mbs],
                                   cfg.train.global_batch * cfg.train.seq_len) * world
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        float(total)  # the step's end, as plait's: the loss read once
        times.append(time.perf_counter() - start)
    return times


def section_peers(args, tmp: Path) -> list[dict]:
    path = str(_token_file(tmp, _peer_config(args, 2).model.vocab_size))
    rows = []
    for label, zero, peer in (("bucketed DP / DDP", 0, "ddp"), ("ZeRO-3 / FSDP2", 3, "fsdp2")):
        kw = {"timeout": args.section_timeout, "backend": _backend(args)}
        mine = run_ranks(_plait_peer, 2, args, path, zero, **kw)[0]
        theirs = run_ranks(_torch_peer, 2, args, path, peer, **kw)[0]
        a, b = statistics.mean(mine[WARMUP:]), statistics.mean(theirs[WARMUP:])
        rows.append({"section": "peers", "check": f"step time {label} (2 ranks, fp32)",
                     "measured": f"{a / b:.2f}x",
                     "expected": f"plait {a * 1e3:.1f} ms, torch {b * 1e3:.1f} ms",
                     "result": "ok" if a / b <= 1.10 else "plait slower by > 10 %"})
    return rows
