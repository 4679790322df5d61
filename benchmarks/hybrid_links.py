"""Hybrid sharding on the links, measured: the same model on two emulated nodes of two
ranks each (`plait cluster`: network namespaces, each node's link shaped to --mbit), once
with ZeRO-3 over dp = 4 (every all-gather and reduce-scatter spans both nodes) and once
with `--dp-shard 2 --dp-replicate 2 --zero 3` (each shard group is a node: the gathers and
reduce-scatters stay inside it, and only the reduced gradient shards cross, all-reduced
over dp_replicate).

    python benchmarks/hybrid_links.py [--mbit 50] [--steps 30] [--recompute selective]
        [--hidden 64] [--layers 2] [--heads 4] [--ffn 176] [--seq 128] [--global-batch 16]
        [--write docs/results/hybrid_links.md]

For each layout, per step and per node: the bytes that crossed the node's link (its
interface's counters over the run, start-up included), the same predicted from the
ledger's collectives by the algorithms gloo runs them with (a ring all-gather sends to
the next rank of the group; plait's reduce-scatter on gloo is a direct all-to-all; a
ring all-reduce), the ledger's inter-node bytes (every byte a rank sends in a group that
spans nodes) and the planner's (`plait plan --layout ... --json`: its collectives on an
inter-node link, each rank's ring share). Beside them, the step time (the median
after the warm-up steps, benchmarks/emulated_nodes.py) and the losses of both runs,
which train the same model on the same batches. Needs root, ip and tc.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

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

from plait.config import load_config
from plait.launch.cluster import capability_problem
from plait.ledger import ring_bytes
from plait.mesh import ParallelMesh

WORLD = NODES * RANKS_PER_NODE
LAYOUTS = {"ZeRO-3 over dp = 4": "dp=4",
           "dp_shard 2 × dp_replicate 2, ZeRO-3": "dp=4,dp_replicate=2"}


def plan(layout: str, model: list[str], out: Path) -> dict:
    """The planner's layout (its collectives) for `layout` on NODES x RANKS_PER_NODE;
    writes its config to `out`."""
    r = plait("plan", *model, "--gpus", str(WORLD), "--gpus-per-node", str(RANKS_PER_NODE),
              "--layout", layout, "--emit-config", str(out), "--json")
    return json.loads(r.stdout)["layouts"][0]


def _ring_op(planned_op: str) -> str:
    """The ledger's name of a planner collective ("all-gather (params, fwd+bwd)")."""
    return planned_op.split()[0].replace("-", "_")


def planned_inter(lay: dict) -> float:
    """A node's inter-node bytes per step as planned."""
    per_rank = sum(ring_bytes(_ring_op(c["op"]), c["bytes"], int(c["group"]))[0] * c["count"]
                   for c in lay["collectives"] if c["link"] == "inter-node")
    return RANKS_PER_NODE * per_rank


def _node(rank: int) -> int:
    return rank // RANKS_PER_NODE


def wire_by_algorithm(rows: dict, config: Path) -> float:
    """Node 0's bytes to the other node per step, from the ledger's collectives (rank 0's
    rows, every rank issuing the same) and the algorithms gloo runs them with."""
    cfg = load_config(config)
    total = 0.0
    for rank in range(RANKS_PER_NODE):
        mesh = ParallelMesh.arithmetic(cfg.parallel, rank)
        for key, row in rows.items():
            op, dim = key.split("@")
            group = mesh.group_ranks.get(dim, list(range(WORLD)))
            n, payload = len(group), row["payload"]
            after = group[(group.index(rank) + 1) % n]  # a ring's next rank
            if op == "reduce_scatter":  # a chunk to every other rank of the group
                total += sum(_node(r) != _node(rank) for r in group) * payload / n
            elif op in ("all_gather", "all_reduce") and _node(after) != _node(rank):
                total += ring_bytes(op, payload, n)[0]
            elif op not in ("all_gather", "all_reduce"):
                raise SystemExit(f"hybrid_links: no wire model for {key}")
    return total


def run_layout(name: str, layout: str, args: argparse.Namespace, work: Path) -> dict:
    config = work / f"{layout.replace(',', '_').replace('=', '')}.toml"
    lay = plan(layout, model_flags(args.size, args.recompute, zero=3, dp=4), config)
    m = measure(config, args.mbit, args.steps, work)
    m["planned"] = planned_inter(lay)
    m["by_algorithm"] = wire_by_algorithm(m["ledger_rows"], config)
    m["name"] = name
    return m


def _bytes_rows(runs: list[dict]) -> list[tuple]:
    return [(m["name"], f"{m['step'] * 1e3:.0f} ms", f"{m['wire_per_step']:,.0f}",
             f"{m['by_algorithm']:,.0f}", f"{m['ledger_inter_per_step']:,.0f}",
             f"{m['planned']:,.0f}") for m in runs]


BYTES_HEADER = ("layout", "step (median)", "wire B/step (a node)",
                "by gloo's algorithms", "ledger inter-node", "planned inter-node")


def _ratio_row(flat: dict, hybrid: dict) -> tuple:
    keys = ("step", "wire_per_step", "by_algorithm", "ledger_inter_per_step", "planned")
    return ("dp = 4 / hybrid", *(f"{flat[k] / hybrid[k]:.2f}" for k in keys))


def _group_rows(runs: list[dict]) -> list[tuple]:
    """Rank 0's ledger per step by collective and group (what each layout sends where)."""
    return [(m["name"], key, f"{row['count']:g}", f"{row['payload']:,.0f}",
             f"{row['sent']:,.0f}", f"{row['sent_inter']:,.0f}")
            for m in runs for key, row in m["ledger_rows"].items()]


def _loss_line(runs: list[dict]) -> str:
    a, b = (m["losses"] for m in runs)
    gap = max(abs(x - y) for x, y in zip(a, b))
    return (f"losses, step 0 to {len(a) - 1}: dp = 4 {a[0]:.4f} … {a[-1]:.4f}, hybrid "
            f"{b[0]:.4f} … {b[-1]:.4f}; largest gap over the steps {gap:.1e}")


def _setting(args: argparse.Namespace) -> str:
    size = ", ".join(f"{k} {v}" for k, v in args.size.items())
    return (f"{NODES} emulated nodes × {RANKS_PER_NODE} ranks (all on this machine's "
            f"{os.cpu_count()} cores), links {args.mbit:g} Mbit/s; tiny with {size}, "
            f"vocabulary 256, recompute {args.recompute}, fp32, one micro-batch a rank, "
            f"{args.steps} steps (the first {WARMUP} not measured)")


def report(runs: list[dict], args: argparse.Namespace) -> None:
    print(_setting(args))
    print(results.table(BYTES_HEADER, [*_bytes_rows(runs), _ratio_row(*runs)]))
    print(results.table(("layout", "op@group", "calls", "payload B", "sent B", "inter-node B"),
                        _group_rows(runs)))
    print(_loss_line(runs))


SHOWS = (
    "with the shard groups inside the nodes, only the reduced gradient shards cross the "
    "link, all-reduced over dp_replicate, so a node sends fewer bytes per step and, where "
    "the link is what a step waits for, the step is shorter. The wire carries the bytes "
    "the ledger's collectives imply under gloo's algorithms plus TCP/IP headers and the "
    "start-up. The ledger (and the planner, by the same convention) counts every byte a "
    "rank sends in a group that spans nodes as inter-node: exact where every peer is on "
    "the other node (dp_replicate here), an over-count for ZeRO over dp = 4, whose ring "
    "all-gather leaves a node on one hop of the ring and whose reduce-scatter sends a "
    "third of its chunks to a rank of the same node. The second table is rank 0's ledger "
    "per step. Both runs train the same model on the same batches; their losses agree to "
    "the reduction order.")


def write(path: Path, runs: list[dict], args: argparse.Namespace, load0: float) -> None:
    sections = [
        f"{_setting(args)}; per step, bytes a node sent to the other:\n\n"
        + results.table(BYTES_HEADER, [*_bytes_rows(runs), _ratio_row(*runs)]),
        "Rank 0's ledger per step:\n\n" + results.table(
            ("layout", "op@group", "calls", "payload B", "sent B", "inter-node B"),
            _group_rows(runs)),
        _loss_line(runs) + "."]
    results.write(path, "Hybrid sharding on the links, measured on emulated nodes",
                  sections, SHOWS, run=results.run_line(load0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(ap, mbit=50.0)
    results.add_write_flag(ap)
    args = parse_run_flags(ap, dp=WORLD)
    load0 = os.getloadavg()[0]
    problem = capability_problem()
    if problem:
        print(f"hybrid_links: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="plait-hybrid-links-") as tmp:
        runs = [run_layout(name, layout, args, Path(tmp)) for name, layout in LAYOUTS.items()]
    report(runs, args)
    if args.write:
        write(Path(args.write), runs, args, load0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
