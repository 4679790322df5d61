"""Keep tensor parallel inside a node, measured (issue 23, item 3): the same model and
layout (dp=2 x tp=2) on two emulated nodes of two ranks each (`plait cluster`: network
namespaces, each node's link shaped to --mbit), once with the default mesh order
(tp innermost: tp inside a node, dp across) and once with dp innermost (tp across the
slow link, dp inside). Beside each measured step time, the planner's (`plait plan
--hardware PROFILE --internode-gbs ... --order ...`, this machine's profile and the
emulated link's bandwidth per rank), and the bytes that crossed each node's link (the
interface's counters) beside the ledger's inter-node bytes.

    python benchmarks/cluster_topology.py [--mbit 100] [--steps 8] [--hardware P.json]

Needs root, ip and tc (plait cluster says what is missing). Measures a profile first
(`plait calibrate --ranks 2`) unless one is given. Step time: the median of the steps
after the first (on a shared machine the median resists a disturbed step). Two columns
of prediction: the planner's step time as is, and "measured inside + planner's link
delta": the default order's measured step plus the planner's difference between the two
orders (compute predicted on an unloaded core does not cancel in the ratio; the link
term is what the order changes).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

from helpers import token_file  # noqa: E402

from plait.cluster import capability_problem  # noqa: E402

MODEL = ["--model", "tiny", "--vocab", "256", "--seq", "128", "--global-batch", "16",
         "--precision", "fp32", "--recompute", "selective", "--zero", "0",
         "--microbatch", "8"]
ORDERS = {"tp inside, dp across (default)": "tp,cp,pp,dp",
          "tp across, dp inside": "dp,tp,cp,pp"}
RANKS_PER_NODE = 2


def plait(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True,
                       text=True, timeout=timeout, cwd=root)
    if r.returncode:
        raise SystemExit(f"plait {' '.join(args[:3])} ... failed:\n{r.stderr[-3000:]}")
    return r


def predict(order: str, profile: Path, mbit: float, out: Path) -> float:
    """The planner's step time (s) for dp=2 x tp=2 under `order`; writes its config."""
    per_rank_gbs = mbit / 8 / 1000 / RANKS_PER_NODE  # a node's link, shared by its ranks
    r = plait("plan", "--hardware", str(profile), *MODEL, "--gpus", "4", "--gpus-per-node",
              str(RANKS_PER_NODE), "--layout", "tp=2,dp=2", "--order", order,
              "--internode-gbs", f"{per_rank_gbs:.6g}", "--emit-config", str(out), "--json")
    return json.loads(r.stdout)["layouts"][0]["step_time_s"]


def measure(config: Path, mbit: float, steps: int, work: Path) -> dict:
    metrics = work / f"{config.stem}.jsonl"
    r = plait("cluster", "--nnodes", "2", "--inter-node-mbit", str(mbit), "--",
              "--config", str(config), "--data", str(token_file()), "--steps", str(steps),
              "--quiet", "--metrics-out", str(metrics), "--timeout", "300")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    summary, steps_rows = rows[-1], rows[:-1]
    sent = [int(b.replace(",", "")) for b in re.findall(r"node \d+ sent ([\d,]+) B", r.stderr)]
    per_step = summary["ledger"]["per_step"]
    ledger_inter = sum(row["sent_inter"] for row in per_step.values())  # rank 0, per step
    return {"step": statistics.median(s["step_time"] for s in steps_rows[1:]),
            "wire_per_step": max(sent) / steps,
            "ledger_inter_per_step": RANKS_PER_NODE * ledger_inter}  # a node's ranks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", type=float, default=100.0, help="each node's link (default 100)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hardware", type=Path, help="a `plait calibrate` profile")
    args = ap.parse_args()
    problem = capability_problem()
    if problem:
        print(f"cluster_topology: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="plait-topology-") as tmp:
        work = Path(tmp)
        profile = args.hardware
        if profile is None:
            profile = work / "profile.json"
            plait("calibrate", "--out", str(profile), "--ranks", "2")
        rows = []
        for name, order in ORDERS.items():
            config = work / f"{order.replace(',', '')}.toml"
            predicted = predict(order, profile, args.mbit, config)
            rows.append((name, order, predicted, measure(config, args.mbit, args.steps, work)))
    print(f"dp=2 x tp=2 on 2 emulated nodes x {RANKS_PER_NODE} ranks, links {args.mbit:g} "
          f"Mbit/s; tiny model, seq 128, global batch 16, fp32, {args.steps} steps")
    print(f"{'layout':34} {'order':12} {'predicted':>10} {'measured':>10} "
          f"{'wire B/step':>12} {'ledger inter B/step':>20}")
    for name, order, pred, m in rows:
        print(f"{name:34} {order:12} {pred * 1e3:8.0f}ms {m['step'] * 1e3:8.0f}ms "
              f"{m['wire_per_step']:12,.0f} {m['ledger_inter_per_step']:20,.0f}")
    (_, _, p_in, m_in), (_, _, p_out, m_out) = rows
    measured_ratio = m_out["step"] / m_in["step"]
    delta_pred = (m_in["step"] + p_out - p_in) / m_in["step"]
    print(f"ratio across / inside: measured {measured_ratio:.2f}, planner {p_out / p_in:.2f} "
          f"(error {p_out / p_in / measured_ratio - 1:+.0%}), measured inside + planner's link "
          f"delta {delta_pred:.2f} (error {delta_pred / measured_ratio - 1:+.0%}); ranking "
          f"{'agrees' if (p_out > p_in) == (m_out['step'] > m_in['step']) else 'DISAGREES'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
