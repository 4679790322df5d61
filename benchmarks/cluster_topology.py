"""Keep tensor parallel inside a node, measured: the same model and
layout (dp=2 x tp=2) on two emulated nodes of two ranks each (`plait cluster`: network
namespaces, each node's link shaped to --mbit), once with the default mesh order
(tp innermost: tp inside a node, dp across) and once with dp innermost (tp across the
slow link, dp inside). Beside each measured step time, the planner's (`plait plan
--hardware PROFILE --internode-gbs ... --order ... --ranks-per-host 4 --host-load B`:
this machine's profile, the emulated link's bandwidth per rank, and the four ranks of
both emulated nodes sharing this machine's cores with B runnable tasks of other work),
and the bytes that crossed each node's link (the interface's counters) beside the
ledger's inter-node bytes.

    python benchmarks/cluster_topology.py [--mbit 100] [--steps 30] [--hardware P.json]
        [--recompute selective] [--hidden 64] [--layers 2] [--heads 4] [--ffn 176]
        [--seq 128] [--global-batch 16] [--write docs/results/cluster_topology.md]

Needs root, ip and tc (plait cluster says what is missing); the runs and their measures
are benchmarks/emulated_nodes.py's. Measures a profile first
(`plait calibrate --ranks 2`) unless one is given. Step time: the median of the steps
after the first WARMUP (on a shared machine the median resists a disturbed step), the
steady step the planner predicts: in runs of 8 steps the window from the second step on
measured 76-107 ms of CPU a rank-step and a 203-257 ms step with tp inside where 30-step
runs measured 61-73 ms and 179-197 ms (the same code and profiles), hence 30 by default.

Measured beside it, to tell the planner's terms apart: B, the runnable scheduling
entities of other work (with autogroup, sessions: the cores are shared among sessions
first; averaged over 3 s just before the run, this benchmark's session left out), and
the CPU seconds each rank used per step (every process in the run's namespaces,
/proc/PID/stat, between the metrics row of step WARMUP and the next-to-last one's, over
steps and ranks; of it "sys", the kernel's part, where the emulated links' and the
loopback's TCP stacks show, and "gloo", the backend's threads'), beside the CPU the
planner gives a rank ("planned": host_share.work_and_waits, compute, recompute, the
optimizer and the collectives' CPU; of it "comm", the collectives', from the profile's
comm_cpu).
Columns: "planner, own core": the planner
with a core per rank (its step less its "host cores shared" term); "planner": its step
with the cores shared (plait/plan/host_share.py); "sharing model, measured CPU": the
same sharing model given the measured CPU per rank-step instead of the planner's (and
the planner's waits: the bubble and the link, the node's ranks in step or not as the
planner has them), which separates the sharing model's error from the compute model's.
The 20 % goal is the planner's ratio against the measured one. `--write PATH` also
writes both tables as markdown (docs/results/cluster_topology.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import results
from emulated_nodes import (  # puts the repository on the path for plait's imports below
    NODES,
    RANKS_PER_NODE,
    WARMUP,
    add_run_flags,
    measure,
    model_flags,
    parse_run_flags,
    plait,
)

from plait.launch.cluster import capability_problem
from plait.plan import host_share

ORDERS = {"tp inside, dp across (default)": "tp,cp,pp,dp",
          "tp across, dp inside": "dp,tp,cp,pp"}
GOAL = 0.20  # the planner's ratio within 20 % of the measured one


def predict(order: str, profile: Path, mbit: float, out: Path, load: float,
            model: list[str]) -> dict:
    """The planner's step time (s) for dp=2 x tp=2 under `order` on shared cores, its
    own-core step, a rank's CPU work and waits in it (host_share.work_and_waits, as the
    planner splits them); writes its config."""
    per_rank_gbs = mbit / 8 / 1000 / RANKS_PER_NODE  # a node's link, shared by its ranks
    r = plait("plan", "--hardware", str(profile), *model, "--gpus", "4", "--gpus-per-node",
              str(RANKS_PER_NODE), "--layout", "tp=2,dp=2", "--order", order,
              "--internode-gbs", f"{per_rank_gbs:.6g}", "--ranks-per-host",
              str(NODES * RANKS_PER_NODE), "--host-load", f"{load:.3g}",
              "--emit-config", str(out), "--force", "--json")  # called twice: rewritten
    lay = json.loads(r.stdout)["layouts"][0]
    terms = lay["time_breakdown_s"]
    own = lay["step_time_s"] - terms.get(host_share.TERM, 0.0)
    colls = [SimpleNamespace(dim=c["dim"], intra=c["link"] != "inter-node", group=c["group"],
                             count=c["count"], size=c["bytes"]) for c in lay["collectives"]]
    comm_cpu = json.loads(profile.read_text())["fit"].get("comm_cpu") or {}
    per_call = comm_cpu.get("call_s", 0.0), comm_cpu.get("byte_s", 0.0)
    cpu, bubble, link = host_share.work_and_waits(terms, colls, own, *per_call)
    comm = host_share.comm_split(terms, colls, *per_call)[0] if any(per_call) else 0.0
    return {"step": lay["step_time_s"], "own": own, "cpu": float(cpu), "comm_cpu": float(comm),
            "bubble": float(bubble), "link": float(link),
            "in_step": bool(host_share.in_step(colls, RANKS_PER_NODE))}


def _ratio_line(name: str, inside: float, across: float, measured: float) -> str:
    r = across / inside
    return f"  {name:34} {r:6.2f}  error {r / measured - 1:+.0%}"


def report(rows: list, args: argparse.Namespace, cores: float) -> None:
    world = NODES * RANKS_PER_NODE
    print(f"dp=2 x tp=2 on {NODES} emulated nodes x {RANKS_PER_NODE} ranks (all {world} on "
          f"this machine's {cores:g} cores), links {args.mbit:g} Mbit/s; "
          f"tiny with {', '.join(f'{k} {v}' for k, v in args.size.items())}, "
          f"vocabulary 256, recompute {args.recompute}, fp32, {args.steps} steps")
    print(f"{'layout':32} {'order':12} {'B':>4} {'load':>5} {'own core':>9} {'planner':>8} "
          f"{'model+CPU':>9} {'measured':>9} {'CPU/rank':>9} {'sys':>7} {'gloo':>7} "
          f"{'planned':>8} {'comm':>6} "
          f"{'wire B/step':>12} {'ledger inter':>13}")
    for name, order, p, m, mod in rows:
        cpu = (f"{m['cpu'] * 1e3:7.0f}ms {m['sys'] * 1e3:5.0f}ms {m['gloo'] * 1e3:5.0f}ms"
               if m["cpu"] else "        -       -       -")
        modt = f"{mod * 1e3:7.0f}ms" if mod else "        -"
        print(f"{name:32} {order:12} {m['load']:4.1f} {m['loadavg']:5.1f} "
              f"{p['own'] * 1e3:7.0f}ms {p['step'] * 1e3:6.0f}ms {modt} "
              f"{m['step'] * 1e3:7.0f}ms {cpu} {p['cpu'] * 1e3:6.0f}ms "
              f"{p['comm_cpu'] * 1e3:4.0f}ms {m['wire_per_step']:12,.0f} "
              f"{m['ledger_inter_per_step']:13,.0f}")
    (_, _, p_in, m_in, mod_in), (_, _, p_out, m_out, mod_out) = rows
    measured = m_out["step"] / m_in["step"]
    print(f"ratio tp across / tp inside (= dp inside / dp across): measured {measured:.2f}")
    print(_ratio_line("planner (cores shared)", p_in["step"], p_out["step"], measured))
    print(_ratio_line("planner, a core per rank", p_in["own"], p_out["own"], measured))
    if mod_in and mod_out:
        print(_ratio_line("sharing model, measured CPU", mod_in, mod_out, measured))
    err = p_out["step"] / p_in["step"] / measured - 1
    ranking = (p_out["step"] > p_in["step"]) == (m_out["step"] > m_in["step"])
    print(f"goal: the planner's ratio within {GOAL:.0%} of the measured: "
          f"{'met' if abs(err) <= GOAL else 'NOT met'} ({err:+.0%}); ranking "
          f"{'agrees' if ranking else 'DISAGREES'}")


def write(path: Path, rows: list, args: argparse.Namespace, cores: float,
          load0: float) -> None:
    """The two tables as markdown: each order's step, and the across / inside ratio."""
    def ms(x: float | None) -> str:
        return "-" if not x else f"{x * 1e3:.0f} ms"
    steps = results.table(
        ("order", "B", "load", "planner, own core", "planner", "model + CPU", "measured",
         "CPU / rank-step (sys, gloo)", "planned CPU (comm)", "wire B/step (a node)",
         "ledger inter-node B/step"),
        [(name, f"{m['load']:.1f}", f"{m['loadavg']:.1f}", ms(p['own']), ms(p['step']),
          ms(mod), ms(m['step']),
          f"{ms(m['cpu'])} ({ms(m['sys'])}, {ms(m['gloo'])})",
          f"{ms(p['cpu'])} ({ms(p['comm_cpu'])})", f"{m['wire_per_step']:,.0f}",
          f"{m['ledger_inter_per_step']:,.0f}") for name, _, p, m, mod in rows])
    (_, _, p_in, m_in, mod_in), (_, _, p_out, m_out, mod_out) = rows
    measured = m_out["step"] / m_in["step"]

    def ratio(inside: float | None, across: float | None) -> str:
        if not inside or not across:
            return "-"
        r = across / inside
        return f"{r:.2f} ({r / measured - 1:+.0%})"
    err = p_out["step"] / p_in["step"] / measured - 1
    ratios = results.table(
        ("measured", "planner (error)", "planner, a core per rank", "model + CPU",
         f"goal ({GOAL:.0%})"),
        [(f"{measured:.2f}", ratio(p_in["step"], p_out["step"]),
          ratio(p_in["own"], p_out["own"]), ratio(mod_in, mod_out),
          "met" if abs(err) <= GOAL else "not met")])
    size = ", ".join(f"{k} {v}" for k, v in args.size.items())
    results.write(
        path, "Tensor parallel inside a node, measured on emulated nodes", [
            f"dp = 2 × tp = 2 on {NODES} emulated nodes × {RANKS_PER_NODE} ranks (all on this "
            f"machine's {cores:g} cores), links {args.mbit:g} Mbit/s; tiny with {size}, "
            f"vocabulary 256, recompute {args.recompute}, fp32, {args.steps} steps (the first "
            f"{WARMUP} not measured):\n\n{steps}",
            f"tp across / tp inside (= dp inside / dp across):\n\n{ratios}"],
        "the same layout with tp inside a node (the default order) and with tp across the "
        "slow link. The planner (with this machine's profile, the ranks sharing its cores) "
        "should rank them as measured and give their ratio within 20 %. \"model + CPU\" is "
        "the planner's cores-sharing model given the measured CPU per rank-step, which tells "
        "the sharing model's error from the compute model's. B is the runnable sessions of "
        "other work. The wire carries the ledger's inter-node bytes plus TCP/IP headers.",
        run=results.run_line(load0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(ap, mbit=100.0)
    ap.add_argument("--hardware", type=Path, help="a `plait calibrate` profile")
    results.add_write_flag(ap)
    args = parse_run_flags(ap, dp=2)
    load0 = os.getloadavg()[0]
    model = model_flags(args.size, args.recompute)
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
        cores = float(json.loads(profile.read_text()).get("cores", 0.0))
        rows = []
        for name, order in ORDERS.items():
            config = work / f"{order.replace(',', '')}.toml"
            predict(order, profile, args.mbit, config, 0.0, model)  # writes the config
            m = measure(config, args.mbit, args.steps, work)
            p = predict(order, profile, args.mbit, config, m["load"], model)
            mod = None
            if m["cpu"] and cores:
                mod = float(host_share.step_on_shared_cores(
                    m["cpu"], p["bubble"], p["link"], cores, NODES * RANKS_PER_NODE,
                    m["load"], RANKS_PER_NODE, p["in_step"]))
            rows.append((name, order, p, m, mod))
    report(rows, args, cores)
    if args.write:
        write(Path(args.write), rows, args, cores, load0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
