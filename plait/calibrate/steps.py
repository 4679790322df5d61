"""`plait calibrate`'s measurements of plait's own training step (plait/calibrate/machine.py
runs them): the aten operations its block and the rest of its step dispatch, the bytes the
element-wise ones move, the dispatch floor (the fastest step of a tiny model in CPU
seconds / its operations), and the block's element-wise operations replayed one by one
(their bandwidth). Timing helper shared with plait/calibrate/machine.py: `best_seconds`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

DEVICE = "cpu"  # as plait/calibrate/machine.py: this machine's CPU


def best_seconds(fn: Any, repeats: int, min_time: float) -> float:
    """The best time of `repeats` runs, each run as many calls as fill `min_time`, in this
    thread's CPU seconds: on one intra-op thread a call's work is this thread's, and its
    CPU time leaves out the time other processes of a shared machine held the core."""
    fn()  # warm-up
    t0 = time.thread_time()
    fn()
    one = max(time.thread_time() - t0, 1e-7)
    calls = max(1, int(min_time / one))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
    return best


# (hidden, ffn, batch, seq) of two 2-layer models whose block's element-wise operations
# are replayed one by one: tensors of a few KiB (the floor) and of a few hundred KiB
ELEMENTWISE_MODELS = [(16, 32, 2, 16), (64, 176, 8, 64)]

# operations that move no data (views, allocations) or are priced elsewhere (GEMMs and the
# attention kernel: their own curves)
NO_TRAFFIC = {"view", "_unsafe_view", "transpose", "t", "expand", "as_strided", "slice",
              "select", "unsqueeze", "squeeze", "detach", "alias", "permute", "split",
              "split_with_sizes", "unbind", "reshape", "lift_fresh", "empty", "empty_like",
              "empty_strided", "mm", "addmm", "bmm"}


def _count_ops(fn: Any) -> tuple[int, int]:
    """(the aten operations `fn` dispatches, forward and autograd's backward alike; the
    bytes the element-wise ones among them read and write: every tensor argument and
    result, views, GEMMs and attention left out)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        n = 0
        traffic = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.n += 1
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in NO_TRAFFIC and "attention" not in name:
                self.traffic += sum(t.numel() * t.element_size() for t in
                                    tree_flatten((args, kwargs, out))[0]
                                    if isinstance(t, torch.Tensor))
            return out

    with Count() as mode:
        fn()
    return mode.n, mode.traffic


def elementwise_replay(dim: int, ffn: int, batch: int, seq: int, reps: int
                        ) -> dict[str, float]:
    """plait's block forward + backward (2 layers, fp32) captured by a dispatch mode; each
    element-wise operation (NO_TRAFFIC and attention left out) replayed on copies of its
    arguments, all of them in the step's order, best of `reps`: their count, the bytes
    they read and write, and their seconds (the real mix: broadcasts, reductions, strided
    views). Every argument is a copy made at capture, so each comes from memory, as a
    backward's saved tensors do, while a forward's freshly written inputs are in L2 in
    the real step: an upper bound of the step's element-wise time (replayed one by one,
    each hot in L2, the same operations ran 1.6-2.7 x faster here: the lower bound)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    from plait.model.loss import token_loss
    from plait.model.presets import ModelConfig
    from plait.model.transformer import build_model

    cfg = ModelConfig(vocab_size=64, dim=dim, n_layers=2, n_heads=2, n_kv_heads=2,
                      ffn_dim=ffn, max_seq_len=seq)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 64, (batch, seq + 1), generator=torch.Generator().manual_seed(0),
                           device=DEVICE)
    calls: list[tuple[Any, Any, Any, int]] = []

    def copy(t: Any) -> Any:
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if name not in NO_TRAFFIC and "attention" not in name:
                nbytes = sum(t.numel() * t.element_size() for t in
                             tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
                calls.append((func, tree_map(copy, args), tree_map(copy, kwargs), nbytes))
            return out

    with Capture():
        token_loss(model(tokens[:, :-1]), tokens[:, 1:], batch * seq).backward()
    def in_order() -> None:  # the step's order: its tensors come and go from the caches
        for f, a, k, _ in calls:
            f(*a, **k)

    seconds = best_seconds(in_order, reps, 0.0)
    return {"hidden": dim, "ops": len(calls), "bytes": float(sum(c[3] for c in calls)),
            "seconds": seconds}


def runtime_steps(layers: int, steps: int, count: bool, recompute: str = "none",
                  tp: int = 1, world: int = 1, clock: Any = time.thread_time
                  ) -> tuple[int, list[float], Any]:
    """plait's own training step (`plait.train.loop.train`: micro-batches, grad norm,
    clip, AdamW, zero_grad, the logged loss) of a model so small that its GEMMs cost
    nothing, on one rank or (`tp`, `world`: this rank of a forked gloo job, SP on, dp =
    world / tp, two sequences a dp rank): (the aten operations of its last step, counted,
    when `count`; else the `clock`'s CPU seconds of every step, the first with the setup,
    by default this thread's; the rank's mesh, its ledger holding every step's calls)."""
    import tempfile

    from torch.utils._python_dispatch import TorchDispatchMode

    from plait.config import load_config
    from plait.mesh import ParallelMesh
    from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file
    from plait.train.loop import TrainOptions, train

    cfg = load_config(sets=["model_name=tiny", "model.vocab_size=64", "model.dim=16",
                            f"model.n_layers={layers}", "model.n_heads=2",
                            "model.n_kv_heads=2", "model.ffn_dim=32", "model.max_seq_len=16",
                            "train.seq_len=16", f"train.global_batch={2 * world // tp}",
                            f"train.steps={steps}", "train.warmup_steps=1",
                            "train.precision=fp32", f"train.recompute={recompute}",
                            f"parallel.tp={tp}", f"parallel.dp={world // tp}",
                            f"parallel.sp={str(tp > 1).lower()}"]).check(world)
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as tmp:
        data = TokenFile.open(synthetic_token_file(f"{tmp}/tokens.bin", 4096, 64, seed=0))
        batches = GlobalBatches(data, 16, 2 * world // tp, cfg.train.seed, 64)
        ops, cpu = [0], [clock()]
        mesh = ParallelMesh.build(cfg.parallel)

        def cpu_times(row: dict) -> None:  # the clock's CPU seconds per step (docstring)
            now = clock()
            times.append(now - cpu[0])
            cpu[0] = now

        times: list[float] = []

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                ops[0] += 1
                return func(*args, **(kwargs or {}))

        def on_step(row: dict) -> None:
            if row["step"] == steps - 2:
                ops[0] = 0  # the last step's operations only (its row's emit included)

        if count:
            with Count():
                train(cfg, mesh, batches, TrainOptions(on_step=on_step))
        else:
            train(cfg, mesh, batches, TrainOptions(on_step=cpu_times))
    return ops[0], times, mesh


def measure_dispatch(quick: bool) -> dict[str, Any]:
    """Operations plait's own block issues forward and backward (counted on 1- and 2-layer
    models: the difference is one layer's) and those of the rest of plait's training step
    (grad norm, clip, optimizer, zero_grad, the logged loss: `optimizer_ops_*`); the
    seconds per operation of plait's training step of a model so small that its GEMMs cost
    nothing (the dispatch floor: the fastest of its steps / its operations), and that
    step's fastest under train.recompute = selective (`step_seconds_selective`)."""
    import torch

    from plait.model.loss import token_loss
    from plait.model.presets import ModelConfig
    from plait.model.transformer import build_model
    from plait.plan.memory import layer_activations
    from plait.plan.shape import from_model_config

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 17), generator=gen, device=DEVICE)
    for layers in (1, 2):
        cfg = ModelConfig(vocab_size=64, dim=16, n_layers=layers, n_heads=2, n_kv_heads=2,
                          ffn_dim=32, max_seq_len=16)
        model = build_model(cfg, seed=0)

        def step(model=model) -> None:
            token_loss(model(tokens[:, :-1]), tokens[:, 1:], 32).backward()

        out[f"step_ops_{layers}"], out[f"elementwise_bytes_{layers}"] = _count_ops(step)
        whole, _, _ = runtime_steps(layers, 3, count=True)
        out[f"optimizer_ops_{layers}"] = whole - out[f"step_ops_{layers}"]
    _, times, _ = runtime_steps(2, 8 if quick else 30, count=False)
    out["step_seconds"] = min(times[1:])  # the first step warms up
    # the same step under plait's selective policy (a dispatch mode sees every operation
    # of the blocks: Python per operation, which the floor's GEMM-free step shows alone)
    _, times, _ = runtime_steps(2, 8 if quick else 30, count=False,
                                recompute="selective")
    out["step_seconds_selective"] = min(times[1:])
    out["runtime_step_ops"] = out["step_ops_2"] + out["optimizer_ops_2"]
    # what the planner's proxy for element-wise traffic says a layer of this model saves
    # (fp32, flash: SDPA's tensors), the unit of `elementwise_passes`
    out["layer_saved_bytes"] = float(layer_activations(
        from_model_config(cfg, seq=16), 2, 1, 1, False, "none", 4, "flash"))
    return out


# CPU seconds of compute each rank runs between two collectives (the runtime's range:
# tp's blocking calls every ~2.4 ms of the closed loop's compute, ZeRO-3's every ~3 ms,
# ZeRO-0's gradient all-reduce and the step's all-reduces after a whole backward or
# pipeline, 7-20 ms of the closed loop's), and the all-reduce's bytes: latency-bound
SYNC_SEGMENTS = (0.5e-3, 2e-3, 4e-3, 16e-3)
SYNC_BYTES = 1 << 10
# a larger call after SYNC_SEGMENTS[0], in the closed loop's range (tp's and ZeRO-3's 104-128
# KiB, ZeRO-0's 521 KiB): whether the extra grows with the bytes (cold buffers)
SYNC_LARGE_BYTES = 128 << 10
# what measure_sync's numbers are (written into the profile with them)
SYNC_STATISTIC = ("mean over every call of the repeats (each call the mean over the ranks); "
                  "*_median_seconds: their median; *_repeats: each repeat's mean")


def measure_sync(mesh: Any, dim: str, calls: int, repeats: int) -> dict[str, Any]:
    """What a collective costs where the runtime issues it, after compute on every rank,
    beyond the same call issued back to back (the alpha-beta fit's setting). For each
    segment length L in SYNC_SEGMENTS: `repeats` x `calls` times, L seconds of this
    thread's CPU in 128 x 128 GEMMs, then a SYNC_BYTES all-reduce over `dim`; and as many
    all-reduces back to back; and after SYNC_SEGMENTS[0], a SYNC_LARGE_BYTES all-reduce
    (`sizes`). Every rank's arrival and exit times (perf_counter: one clock for the ranks
    of one host) are all-gathered, and each call split into
      wait  = the last rank's arrival - this rank's (the ranks' compute jitter: they
              leave a compute of equal CPU work at different times; the wait for the
              slower rank),
      after = exit - the last rank's arrival (the collective itself, with the backend's
              wake-up once every rank has come).
    Both are means over the ranks, per call. Of the calls the mean (what a step of such
    calls pays) and the median (`*_median_seconds`: the body without the tail), each
    repeat's mean kept (its spread). Measured on this machine (quiet): a
    call's extra after 2.4 ms is heavy-tailed, 0.3 ms at the 10th percentile and 3-5.5
    ms at the 90th (about the kernel's 4 ms scheduler tick: a woken gloo thread queued
    behind a computing one), so the median of 30 calls flips between the modes (0.03-2.3
    ms of extra across calibrates) where the mean of 180 read 1.4-1.8 ms after the last
    arrival in eight runs. Wall clock: both are waits, not work."""
    import torch

    from plait.comm import ops

    n = mesh.size(dim)
    small = torch.ones(SYNC_BYTES // 4, device=DEVICE)
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(0), device=DEVICE)

    def compute(seconds: float) -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < seconds:
            a @ a

    def run(seconds: float | None, x: Any) -> tuple[list[float], list[float]]:
        times = torch.empty(calls, 2, dtype=torch.float64, device=DEVICE)
        ops.all_reduce(torch.zeros(1, device=DEVICE), mesh, dim, tag="calibrate")  # together
        for i in range(calls):
            if seconds is not None:
                compute(seconds)
            times[i, 0] = time.perf_counter()
            ops.all_reduce(x, mesh, dim, tag="calibrate")
            times[i, 1] = time.perf_counter()
        every = torch.empty(n * calls * 2, dtype=torch.float64, device=DEVICE)
        ops.all_gather(every, times.reshape(-1), mesh, dim, tag="calibrate")
        every = every.reshape(n, calls, 2)
        last = every[:, :, 0].max(dim=0).values
        wait = (last - every[:, :, 0]).mean(dim=0)  # per call, over the ranks
        return wait.tolist(), (every[:, :, 1] - last).mean(dim=0).tolist()

    def row(seconds: float | None, x: Any = small) -> dict[str, Any]:
        waits, afters = zip(*(run(seconds, x) for _ in range(repeats)), strict=True)
        every_wait, every_after = sum(waits, []), sum(afters, [])
        return {"wait_seconds": statistics.fmean(every_wait),
                "after_seconds": statistics.fmean(every_after),
                "wait_median_seconds": statistics.median(every_wait),
                "after_median_seconds": statistics.median(every_after),
                "wait_repeats": [statistics.fmean(w) for w in waits],
                "after_repeats": [statistics.fmean(w) for w in afters]}

    back = row(None)
    rows = [{"compute_seconds": seconds, **row(seconds)} for seconds in SYNC_SEGMENTS]
    large = row(SYNC_SEGMENTS[0], torch.ones(SYNC_LARGE_BYTES // 4, device=DEVICE))
    return {"group": n, "bytes": SYNC_BYTES, "statistic": SYNC_STATISTIC,
            "calls": calls * repeats, "back_to_back_seconds": back["after_seconds"],
            "back_to_back_repeats": back["after_repeats"], "segments": rows,
            "sizes": [{"bytes": SYNC_LARGE_BYTES, "compute_seconds": SYNC_SEGMENTS[0],
                       **large}]}

# a pipeline transfer's bytes here: the closed loop's activation (2 x 64 tokens x 64 fp32)
POST_BYTES = 32 << 10


def measure_post(mesh: Any, dim: str, calls: int, repeats: int) -> dict[str, Any]:
    """What posting one batch of pipeline transfers costs the rank, as the pipeline
    runtime posts them (plait/parallel/pipeline/runtime.py's `_post`: one
    `batch_send_recv`, here a POST_BYTES send to the group's next rank and a receive from
    its previous one) after SYNC_SEGMENTS[0] of compute on every rank: the wall seconds
    of the call alone (gloo's posting, blocked or descheduled, not only its CPU); then as
    much compute again, and the wall seconds of completing the transfers (recorded, not
    priced: it holds the wake-up latency a pipeline transfer's latency already carries).
    Means over `calls`, the best of `repeats` (by the post and completion together)."""
    import torch

    from plait.comm import ops

    group = mesh.group_ranks[dim]
    me = group.index(mesh.rank)
    nxt, prev = group[(me + 1) % len(group)], group[(me - 1) % len(group)]
    x = torch.ones(POST_BYTES // 4, device=DEVICE)
    buf = torch.empty_like(x)
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(0), device=DEVICE)

    def spin() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < SYNC_SEGMENTS[0]:
            a @ a

    def run() -> tuple[float, float, float]:
        ops.all_reduce(torch.zeros(1, device=DEVICE), mesh, dim, tag="calibrate")  # together
        wall = cpu = done = 0.0
        for _ in range(calls):
            spin()
            w0, c0 = time.perf_counter(), time.thread_time()
            handles = ops.batch_send_recv([(x, nxt)], [(buf, prev)], mesh, dim,
                                          tag="calibrate")
            wall += time.perf_counter() - w0
            cpu += time.thread_time() - c0
            spin()
            w0 = time.perf_counter()
            for h in handles:
                h.wait()
            done += time.perf_counter() - w0
        return wall / calls, cpu / calls, done / calls

    wall, cpu, done = min((run() for _ in range(repeats)), key=lambda r: r[0] + r[2])
    return {"group": len(group), "bytes": POST_BYTES, "compute_seconds": SYNC_SEGMENTS[0],
            "post_seconds": wall, "post_cpu_seconds": cpu, "complete_seconds": done}


def measure_gap(world: int, steps: int, repeats: int) -> dict[str, Any]:
    """plait's pipeline runtime's own time before each compute action that did not wait
    for its input (`runtime_stats.runtime_gap`, the simulator's `Durations.gap`: the loop's
    Python, completing a receive already there, reaping sends; posts and waits left out),
    measured by training: a 2-layer model of hidden 16 (the dispatch floor's) at pp = 2,
    1F1B over 4 micro-batches, dp = world / 2, `steps` steps (the first left out), on
    every rank of `world` (even). Seconds per compute, each repeat's mean over its steps
    and computes; the median of `repeats` and each repeat's kept (its spread)."""
    import tempfile

    from plait.config import load_config
    from plait.mesh import ParallelMesh
    from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file
    from plait.train.loop import train

    dp = world // 2
    cfg = load_config(sets=["model_name=tiny", "model.vocab_size=64", "model.dim=16",
                            "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2",
                            "model.ffn_dim=32", "model.max_seq_len=16", "train.seq_len=16",
                            f"train.global_batch={8 * dp}", f"train.steps={steps}",
                            "train.warmup_steps=1", "train.precision=fp32",
                            "parallel.pp=2", f"parallel.dp={dp}", "parallel.microbatches=4",
                            "parallel.schedule=1f1b"]).check(world)
    gaps = []
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as tmp:
        data = TokenFile.open(synthetic_token_file(f"{tmp}/tokens.bin", 4096, 64, seed=0))
        for _ in range(repeats):
            batches = GlobalBatches(data, 16, 8 * dp, cfg.train.seed, 64)
            result = train(cfg, ParallelMesh.build(cfg.parallel), batches)
            gaps.append(result.pipeline["summary"]["durations_ms"]["gap"] / 1e3)
    return {"pp": 2, "microbatches": 4, "schedule": "1f1b", "steps": steps,
            "gap_seconds": statistics.median(gaps), "gap_repeats": gaps}
