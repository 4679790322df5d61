"""Pipeline schedules: plait's runtime vs torch.distributed.pipelining, same model, one run.

    python benchmarks/pp_vs_torch.py [--steps 8] [--dim 128] [--layers 8]

pp=4, m=8, gloo on CPU, one thread per rank. For each pair (1f1b / Schedule1F1B, interleaved
v=2 / ScheduleInterleaved1F1B, zb-v / ScheduleZBVZeroBubble, dualpipev / ScheduleDualPipeV)
both run the same stage modules (plait's partition, same name-seeded weights) on the same
micro-batches; the optimizer is left out, so a step is one pass of the schedule. Step time
is barrier to barrier, median over the steps after WARMUP. Measured bubble, for both, is
1 - (compute busy summed over ranks) / (4 x step time): plait's busy time comes from its
runtime's records; torch's from timing wrappers on each stage's forward_one_chunk /
backward_one_chunk / backward_weight_one_chunk. plait's own report (span from the first
rank entering the step, simulator prediction for the measured mean durations) is printed
beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.config import load_config  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.parallel.pipeline.measure import pipeline_report  # noqa: E402
from plait.parallel.pipeline.partition import build_pipeline  # noqa: E402
from plait.parallel.pipeline.runtime import PipelineRuntime  # noqa: E402
from plait.testing import run_ranks  # noqa: E402
from plait.train.step import token_loss  # noqa: E402

PP, M, WARMUP = 4, 8, 2
PAIRS = [("1f1b", "Schedule1F1B"), ("interleaved", "ScheduleInterleaved1F1B"),
         ("zb-v", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")]


def _cfg(args, schedule):
    return load_config(sets=[
        f"parallel.pp={PP}", f"parallel.schedule={schedule}", f"parallel.microbatches={M}",
        f"model.n_layers={args.layers}", f"model.dim={args.dim}", f"model.ffn_dim={args.ffn}",
        f"model.vocab_size={args.vocab}", f"train.seq_len={args.seq_len}",
        f"train.global_batch={args.batch}"]).check(PP)


def _timed_step(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _plait(cfg, mesh, tokens, steps):
    pipe = build_pipeline(cfg, mesh.coord("pp"), torch.float32)
    mbs = cfg.micro_batch_size()
    rt = PipelineRuntime(pipe.schedule, pipe.stages, mesh, (mbs, cfg.train.seq_len,
                         cfg.model.dim), torch.float32)
    micro = [tokens[i * mbs:(i + 1) * mbs] for i in range(M)]
    ntok = tokens[:, 1:].numel()
    times, busy = [], []
    for _ in range(steps):
        times.append(_timed_step(lambda: rt.step(micro, ntok)))
        busy.append(sum(e - s for _, _, _, s, e in rt.steps_events[-1]))
        pipe.model.zero_grad(set_to_none=True)
    return times, busy, pipe, pipe_report(rt, pipe, mesh)


def pipe_report(rt, pipe, mesh):
    rep = pipeline_report(rt, pipe.partition, mesh)["summary"]
    return {k: rep[k] for k in ("measured_bubble", "simulated_bubble", "mean_ms")}


class _Logits(torch.nn.Module):
    """A plait Stage as torch pipelining wants it: the last returns logits, not the loss."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        return self.stage(x)


def _torch(cfg, mesh, tokens, steps, cls_name, stages_by_id, num_stages):
    from torch.distributed import pipelining

    group = mesh.group("pp")
    mbs = cfg.micro_batch_size()
    ntok = tokens[:, 1:].numel()
    stages, busy_now = [], [0.0]
    for sid in sorted(stages_by_id):
        example = (tokens[:mbs, :-1] if sid == 0 else
                   torch.zeros(mbs, cfg.train.seq_len, cfg.model.dim))
        st = pipelining.PipelineStage(_Logits(stages_by_id[sid]), sid, num_stages,
                                      torch.device("cpu"), input_args=(example,), group=group)
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            orig = getattr(st, name)

            def timed(*a, _orig=orig, **k):
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    busy_now[0] += time.perf_counter() - t0
            setattr(st, name, timed)
        stages.append(st)
    cls = getattr(pipelining, cls_name)

    def loss_fn(logits, target):
        return token_loss(logits, target, ntok)

    sched = cls(stages if len(stages) > 1 else stages[0], M, loss_fn=loss_fn,
                scale_grads=False)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def run():
        kwargs = {"target": y} if has_last else {}
        if has_first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)

    times, busy = [], []
    for _ in range(steps):
        busy_now[0] = 0.0
        times.append(_timed_step(run))
        busy.append(busy_now[0])
        for s in stages:
            s.submod.zero_grad(set_to_none=True)
    return times, busy


def _bubble(times, busy, mesh):
    """1 - busy summed over ranks / (pp x step), per measured step, median."""
    out = []
    for t, b in zip(times[WARMUP:], busy[WARMUP:], strict=True):
        total = torch.tensor([b], dtype=torch.float64)
        dist.all_reduce(total, group=mesh.group("pp"))
        out.append(1 - float(total) / (PP * t))
    return statistics.median(out)


def _rank(rank, world, args):
    torch.manual_seed(0)
    results = {}
    for ours, theirs in PAIRS:
        cfg = _cfg(args, ours)
        mesh = ParallelMesh.build(cfg.parallel)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1),
                               generator=torch.Generator().manual_seed(1))
        t_p, b_p, pipe, rep = _plait(cfg, mesh, tokens, args.steps)
        fresh = build_pipeline(cfg, mesh.coord("pp"), torch.float32)  # same weights, no grads
        t_t, b_t = _torch(cfg, mesh, tokens, args.steps, theirs, fresh.stages,
                          fresh.schedule.num_stages)
        results[ours] = {
            "theirs": theirs, "plait_s": statistics.median(t_p[WARMUP:]),
            "torch_s": statistics.median(t_t[WARMUP:]),
            "plait_bubble": _bubble(t_p, b_p, mesh), "torch_bubble": _bubble(t_t, b_t, mesh),
            "report": rep, "partition": fresh.partition.describe(),
        }
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=352)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    res = run_ranks(_rank, PP, args, timeout=900, pg_timeout=120)[0]
    print(f"pp={PP} m={M}, gloo CPU, dim {args.dim}, {args.layers} layers, seq {args.seq_len}, "
          f"batch {args.batch}; {res['1f1b']['partition']}")
    print(f"{'schedule':<12}{'torch':<26}{'plait ms':>9}{'torch ms':>9}{'ratio':>7}"
          f"{'bubble plait':>13}{'bubble torch':>13}{'plait report: meas':>20}{'sim':>7}")
    for ours, r in res.items():
        rep = r["report"]
        print(f"{ours:<12}{r['theirs']:<26}{r['plait_s'] * 1e3:>9.1f}{r['torch_s'] * 1e3:>9.1f}"
              f"{r['plait_s'] / r['torch_s']:>7.2f}{r['plait_bubble']:>13.1%}"
              f"{r['torch_bubble']:>13.1%}{rep['measured_bubble']:>20.1%}"
              f"{rep['simulated_bubble']:>7.1%}")
    base = res["1f1b"]["plait_bubble"]
    for name in ("zb-v", "dualpipev"):
        print(f"{name} bubble / 1f1b bubble (plait): {res[name]['plait_bubble'] / base:.2f} "
              "(goal <= 0.33)")


if __name__ == "__main__":
    main()
