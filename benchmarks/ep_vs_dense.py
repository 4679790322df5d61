"""Expert parallel against experts replicated over data parallel, on the same MoE model,
and the local expert computation grouped against a loop over experts.

    python benchmarks/ep_vs_dense.py [--experts 16] [--steps 5] [--world 4]

1. Training (`plait.train.loop.train`, world ranks, gloo on CPU): ep = world against ep = 1
   (every rank holds every expert, dp = world): mean step time (the first step left out),
   the tracker's peak bytes per rank on step 1 (parameters, gradients, optimizer states),
   and the all-to-all bytes per step from the ledger beside the planner's formula
   (`plait.plan.estimate_config`: 4 all-to-alls of tokens * k rows a layer and
   micro-batch, the group's mean payload).
2. One MoE layer's experts on sorted tokens: `Experts` with one grouped matmul per weight
   against the same weights looped over experts, forward + backward, best of --reps.

The torch-native peer for the all-to-all is torch's own `all_to_all_single`, which plait's
dispatch calls (through its ledger); there is no torch MoE layer to compare against. Ratios
are plait's ep / replicated and grouped / loop; 2 shared CPU cores make absolute times mean
little.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.config import load_config  # noqa: E402
from plait.launch.forked import run_ranks  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402
from plait.model.moe import Experts  # noqa: E402
from plait.plan import estimate_config  # noqa: E402
from plait.train.data import GlobalBatches, TokenFile, synthetic_token_file  # noqa: E402
from plait.train.loop import train  # noqa: E402


def _cfg(args, ep: int):
    return load_config(sets=[
        f"parallel.dp={args.world}", f"parallel.ep={ep}", f"train.steps={args.steps}",
        "train.global_batch=8", "train.seq_len=64", "model.vocab_size=256",
        "train.memory_step=1", f"model.n_experts={args.experts}", "model.top_k=2",
        "model.expert_ffn_dim=128", "model.n_layers=2", "model.aux_loss_coef=0.01"]
    ).check(args.world)


def _train(rank, world, args, path, ep):
    cfg = _cfg(args, ep)
    mesh = ParallelMesh.build(cfg.parallel)
    t = cfg.train
    res = train(cfg, mesh, GlobalBatches(TokenFile.open(path), t.seq_len, t.global_batch,
                                         t.seed, cfg.model.vocab_size))
    peak = res.metrics[1]["memory"]["peak"]
    a2a = [r for r in mesh.ledger.records if r.op == "all_to_all" and r.step == 1
           and not r.tag.endswith(".counts")]
    return {"time": statistics.mean(m["step_time"] for m in res.metrics[1:]),
            "states": sum(peak.get(k, 0) for k in ("params", "grads", "optimizer")),
            "a2a_payload": sum(r.payload for r in a2a), "loss": res.losses[-1]}


def _experts_time(args, grouped: bool) -> float:
    torch.manual_seed(0)
    ex = Experts(args.experts, 64, 128, grouped=grouped)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.02)
    counts = torch.full((args.experts,), args.rows // args.experts)
    x = torch.randn(int(counts.sum()), 64, requires_grad=True)
    best = float("inf")
    for _ in range(args.reps):
        t0 = time.perf_counter()
        ex(x, counts).sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4096, help="sorted token rows (part 2)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokens.bin"
        synthetic_token_file(path, 100_000, 256, seed=0)
        runs = {ep: run_ranks(_train, args.world, args, path, ep) for ep in (1, args.world)}
    print(f"1. training, {args.world} ranks, {args.experts} experts top-2")
    print(f"{'layout':<24}{'step ms':>10}{'states/rank':>14}{'a2a B/step':>14}"
          f"{'planner':>12}{'loss':>9}")
    for ep, outs in runs.items():
        est = estimate_config(_cfg(args, ep))
        coll = [c for c in est.collectives if c.dim == "ep"]
        planned = float(coll[0].size * coll[0].count) if coll else 0.0
        def mean(k: str, outs: list[dict] = outs) -> float:
            return statistics.mean(o[k] for o in outs)
        name = f"ep={ep}" + (" (replicated)" if ep == 1 else "")
        print(f"{name:<24}{mean('time') * 1e3:>10.1f}{mean('states') / 2**20:>11.2f} MiB"
              f"{mean('a2a_payload'):>14,.0f}{planned:>12,.0f}{outs[0]['loss']:>9.4f}")
    ep, rep = runs[args.world], runs[1]
    t = lambda o: statistics.mean(r["time"] for r in o)  # noqa: E731
    s = lambda o: statistics.mean(r["states"] for r in o)  # noqa: E731
    print(f"ratio ep/replicated: step time {t(ep) / t(rep):.2f}, "
          f"model-state memory {s(ep) / s(rep):.2f}")
    g, loop = _experts_time(args, True), _experts_time(args, False)
    print(f"2. {args.experts} experts, {args.rows} rows, fwd+bwd: grouped {g * 1e3:.1f} ms, "
          f"loop {loop * 1e3:.1f} ms, ratio grouped/loop {g / loop:.2f}")


if __name__ == "__main__":
    main()
