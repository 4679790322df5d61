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

Needs root, ip and tc (plait cluster says what is missing). Measures a profile first
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
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

import results  # noqa: E402
from helpers import token_file  # noqa: E402

from plait.files import PARTIAL_SUFFIX  # noqa: E402
from plait.launch.cluster import capability_problem  # noqa: E402
from plait.plan import host_share  # noqa: E402

# the model: `tiny` with these fields replaced (vocabulary 256: the test token file's);
# dp's micro-batch is its whole half of the batch. The default is tiny's own shape (every
# run in docs/results/cluster_topology.md); the flags give larger ones (the closed loop's
# h 256 prices compute within 15 % at world <= 2; here the emulated links' and
# collectives' CPU and the link model weigh in too).
SIZE = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 176, "seq": 128, "global_batch": 16}


def model_flags(size: dict[str, int], recompute: str) -> list[str]:
    """One meaning in plan and train (the emitted config carries the shape)."""
    return ["--model", "tiny", "--vocab", "256", "--hidden", str(size["hidden"]),
            "--layers", str(size["layers"]), "--heads", str(size["heads"]),
            "--kv-heads", str(size["heads"]), "--ffn", str(size["ffn"]),
            "--seq", str(size["seq"]), "--global-batch", str(size["global_batch"]),
            "--microbatch", str(size["global_batch"] // 2), "--precision", "fp32",
            "--recompute", recompute, "--zero", "0"]


ORDERS = {"tp inside, dp across (default)": "tp,cp,pp,dp",
          "tp across, dp inside": "dp,tp,cp,pp"}
RANKS_PER_NODE = 2


NODES = 2
WARMUP = 5  # steps not measured: the step median and the CPU window start after them
GOAL = 0.20  # the planner's ratio within 20 % of the measured one


def plait(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True,
                       text=True, timeout=timeout, cwd=root)
    if r.returncode:
        raise SystemExit(f"plait {' '.join(args[:3])} ... failed:\n{r.stderr[-3000:]}")
    return r


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
              "--emit-config", str(out), "--json")
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


def _runnable_groups(own: str) -> int:
    """Scheduling entities with a runnable task now: with autogroup (Linux's default here:
    /proc/sys/kernel/sched_autogroup_enabled) the scheduler shares the cores among
    sessions first, so a session counts once, whatever its runnable tasks (torchrun starts
    each rank in a session of its own); without it, each task. `own` (this sampler's
    group) is left out."""
    groups = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] != "R":
                continue
            group = (stat.parent / "autogroup").read_text().split()[0] if AUTOGROUP \
                else stat.parent.name
        except (OSError, IndexError):
            continue  # ended meanwhile
        if group != own:
            groups.add(group)
    return len(groups)


AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled").is_file() and \
    Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"


def background_load(seconds: float = 3.0) -> float:
    """Runnable scheduling entities of other work (`_runnable_groups`), averaged over
    `seconds` just before a run (this benchmark's own session left out)."""
    own = Path("/proc/self/autogroup").read_text().split()[0] if AUTOGROUP else str(os.getpid())
    counts = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        counts.append(_runnable_groups(own))
        time.sleep(0.05)
    return statistics.mean(counts)


def _stat_cpu(stat: Path) -> tuple[float, float]:
    """(user + system, system) CPU seconds of a /proc stat file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick


def _cpu_seconds(prefix: str) -> tuple[float, float, float]:
    """CPU seconds of every process in the namespaces named `prefix`*: all (user +
    system), the system part, and that of the backend's threads (gloo's: their names
    start with gloo or pt_gloo)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    total, system, backend = 0.0, 0.0, 0.0
    for name in (x.split()[0] for x in names.splitlines() if x.startswith(prefix)):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                cpu, sys_cpu = _stat_cpu(Path(f"/proc/{pid}/stat"))
                for task in Path(f"/proc/{pid}/task").iterdir():
                    if (task / "comm").read_text().startswith(("gloo", "pt_gloo")):
                        backend += _stat_cpu(task / "stat")[0]
            except OSError:
                continue  # ended meanwhile
            total, system = total + cpu, system + sys_cpu
    return total, system, backend


def _watch_cpu(proc: subprocess.Popen, partial: Path, steps: int, out: dict) -> None:
    """CPU seconds of the run's processes when the metrics hold WARMUP rows and steps - 1."""
    prefix, marks = f"plaitc-{proc.pid}-", {WARMUP: None, steps - 1: None}
    while proc.poll() is None and any(v is None for v in marks.values()):
        try:
            rows = partial.read_text().count("\n")
        except OSError:
            rows = 0
        for k in marks:
            if marks[k] is None and rows >= k:
                marks[k] = (rows, _cpu_seconds(prefix))
        time.sleep(0.02)
    if all(marks.values()):
        (r0, (c0, s0, g0)), (r1, (c1, s1, g1)) = marks[WARMUP], marks[steps - 1]
        if r1 > r0:
            rank_steps = (r1 - r0) * NODES * RANKS_PER_NODE
            out["cpu_per_rank_step"] = (c1 - c0) / rank_steps
            out["sys_per_rank_step"] = (s1 - s0) / rank_steps
            out["gloo_per_rank_step"] = (g1 - g0) / rank_steps


def measure(config: Path, mbit: float, steps: int, work: Path) -> dict:
    metrics = work / f"{config.stem}.jsonl"
    load = background_load()
    cmd = [sys.executable, "-m", "plait.cli", "cluster", "--nnodes", str(NODES),
           "--inter-node-mbit", str(mbit), "--", "--config", str(config), "--data",
           str(token_file()), "--steps", str(steps), "--quiet", "--metrics-out",
           str(metrics), "--timeout", "300"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=root)
    cpu: dict = {}
    watcher = threading.Thread(target=_watch_cpu, daemon=True, args=(
        proc, metrics.with_name(metrics.name + PARTIAL_SUFFIX), steps, cpu))
    watcher.start()
    _, stderr = proc.communicate(timeout=900)
    watcher.join(timeout=5)
    if proc.returncode:
        raise SystemExit(f"plait cluster failed:\n{stderr[-3000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    summary, steps_rows = rows[-1], rows[:-1]
    sent = [int(b.replace(",", "")) for b in re.findall(r"node \d+ sent ([\d,]+) B", stderr)]
    per_step = summary["ledger"]["per_step"]
    ledger_inter = sum(row["sent_inter"] for row in per_step.values())  # rank 0, per step
    return {"step": statistics.median(s["step_time"] for s in steps_rows[WARMUP:]),
            "wire_per_step": max(sent) / steps, "load": load,
            "loadavg": os.getloadavg()[0], "cpu": cpu.get("cpu_per_rank_step"),
            "sys": cpu.get("sys_per_rank_step"), "gloo": cpu.get("gloo_per_rank_step"),
            "ledger_inter_per_step": RANKS_PER_NODE * ledger_inter}  # a node's ranks


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
    ap.add_argument("--mbit", type=float, default=100.0, help="each node's link (default 100)")
    ap.add_argument("--steps", type=int, default=30,
                    help=f"default 30; the first {WARMUP} are not measured")
    ap.add_argument("--hardware", type=Path, help="a `plait calibrate` profile")
    ap.add_argument("--recompute", default="selective", choices=("none", "selective", "full"))
    for k, v in SIZE.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v, metavar="N",
                        help=f"default {v}")
    results.add_write_flag(ap)
    args = ap.parse_args()
    args.size = {k: getattr(args, k) for k in SIZE}
    load0 = os.getloadavg()[0]
    if args.steps < WARMUP + 3:
        ap.error(f"--steps: give at least {WARMUP + 3} (the first {WARMUP} are not measured)")
    if args.size["global_batch"] % 2:
        ap.error("--global-batch: give an even number (dp 2)")
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
