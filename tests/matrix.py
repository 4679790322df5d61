"""The parity matrix's layouts: factors, the row notation, pairwise coverage.

A row is one layout in a short notation, one token per setting, e.g.

    dp2 z1 tp2 sp pp2:1f1b cp2:ring moe ep2 bf16 rc

`dpN` data parallel (`dpNxM`: hybrid sharding, dp_shard N x dp_replicate M), `zN` ZeRO
stage, `tpN` (+ `sp`) tensor (+ sequence) parallel,
`ppN:SCHEDULE` pipeline, `cpN:MODE` context parallel (ring | allgather | a2a |
hierarchical/A, all-to-all groups of A ranks and a ring across them), `moe` the MoE
model (`epN` experts over ep ranks), `mla` multi-head latent attention (plait/model/mla.py)
in place of GQA, `bf16` bf16 compute with fp32 masters, `rc` full recomputation, `rcs`
selective (plait/model/recompute.py's default ops), `atp` async tensor parallel, `docs`
packed documents (`train.documents`: attention and loss inside each document), `fp8`
float8 GEMMs in a float64 model (`train.fp8_compute=fp64`), `cmp` regional compilation
(aot_eager: dynamo and AOTAutograd, without inductor's code generation), `ofb` DualPipe's
F&B pairs run overlapped (`parallel.overlap_fb`). Omitted: dp1 z0
tp1 pp1 cp1, the dense model, GQA, float64 (the oracle's precision), no recompute.

`FACTORS` are the levels the matrix must combine: every *pair* of levels of two factors
that some valid layout at world <= 8 has, appears in some row (pairwise, or "all-pairs",
covering: most bugs of combined strategies need two of them to show; Kuhn, Wallace &
Gallo, "Software fault interactions and implications for software testing", IEEE TSE
2004). A pair no valid layout has is refused by `Config.validate` with its reason, and
the test lists it. Every pipeline schedule appears at least once.

The attention block is not a factor: the cover is over GQA's layouts, and `MLA_ROWS` are a
few more, chosen by hand, that meet every dimension MLA changes (tp's split of the heads
and its replicated down-projections, with and without SP; cp's per-head K/V in both
modes; pp; ZeRO-3; bf16; both recomputations) at three launches.

`LONG_CONTEXT_ROWS`, also by hand, put context parallel's all-to-all modes (Ulysses'
`a2a`) beside what they must compose with, several dimensions a launch: tp + SP (heads split
twice), ZeRO-3, MoE's ep over dp x cp, a zero-bubble pipeline (the all-to-all's backward
inside I) with recomputation (its forward all-to-alls replayed); the hierarchical mode
(all-to-all pairs, a ring across them) with dp, ZeRO-1 and selective recomputation.

`python tests/matrix.py` prints a greedy cover of the factors (the rows below were made
by it, then kept as text so that a change of factor shows as a failing coverage test, not
as a silently different matrix).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterable

# the model of every row: 4 layers (pp=2 with two chunks a rank needs 4 stages; pp=4 one
# layer a stage), untied (pp and ZeRO need it); the MoE rows add 8 experts top-2 with a
# shared expert, the balance loss and the aux-loss-free bias (a buffer every layout must
# keep in step)
DENSE = ("model.n_layers=4", "model.tie_embeddings=false")
MOE = (*DENSE, "model.n_experts=8", "model.top_k=2", "model.expert_ffn_dim=32",
       "model.n_shared_experts=1", "model.aux_loss_coef=0.01", "model.bias_update_rate=0.01")
# multi-head latent attention at the tiny-mla preset's widths (query latent 32, key/value
# latent 16, 16 + 8 RoPE features a head, values 16)
MLA = ("model.attention=mla", "model.q_lora_rank=32", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16")
# settings that change what is computed, not where: the single-process reference runs them
# too (packed documents; float8 GEMMs, in a float64 model so that the bounds stay float64's)
RECIPES = {"docs": ("train.documents=true",),
           "fp8": ("train.precision=fp8", "train.fp8_compute=fp64")}
# regional compilation changes neither: the reference runs eagerly
COMPILE = ("train.compile=true", "train.compile_backend=aot_eager")
# every row trains 3 steps (the last update is seen by the parameters only, the one before
# by the loss too); round trips save after step 1 and resume for steps 2 and 3
STEPS = 3
ROUND_TRIP_STEP = 1

FACTORS: dict[str, tuple[str, ...]] = {
    "dp": ("dp1", "dp2", "dp4", "dp2x2"),
    "zero": ("z0", "z1", "z2", "z3"),
    "tp": ("tp1", "tp2", "tp2+sp"),
    "pp": ("pp1", "pp2", "pp4"),
    "cp": ("cp1", "cp2:ring", "cp2:allgather"),
    "ep": ("dense", "moe ep1", "moe ep2", "moe ep4"),
    "precision": ("fp64", "bf16"),
    "recompute": ("rc:none", "rc:full", "rc:selective"),
}
# the factors a schedule must meet each level of: what reshapes what it moves between
# stages (tp and SP split the activation, cp its positions); dp, ZeRO, ep, precision and
# recompute meet the schedules through the pairwise cover (pp levels), which keeps the
# suite's time in bounds
SCHEDULE_PAIRS = ("tp", "cp")
COST_FIXED = 2  # a row's time ~ (this + world size) x a step: ranks share 2 cores
# recomputing costs a forward: ~1.3x a step with full; selective ~1.75x on CPU (torch's
# selective checkpoint runs a Python hook on every op; docs/recompute.md)
RECOMPUTE_COST = {"rc:none": 1.0, "rc:full": 1.3, "rc:selective": 1.75}
# bf16 rows are held to looser bounds (no first-gradient check with MoE): a pair is better
# met in fp64 where it can be, so a bf16 row counts as dearer
PRECISION_COST = {"fp64": 1.0, "bf16": 1.5}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev",
             "dualpipe")

ROWS: tuple[str, ...] = (
    'moe',
    'z3 cp2:ring moe ep2',
    'z2 cp2:allgather',
    'dp2 z1 pp2:zb-v moe ep2',
    'tp2 sp rc',
    'dp4 z3 moe ep4',
    'tp2 moe bf16',
    'z1 pp2:zb-h2 cp2:ring moe rc',
    'pp2:zb-h1 rcs',
    'pp4:gpipe moe',
    'dp2 z2 moe ep2 bf16 rc',
    'z3 tp2 sp cp2:allgather moe',
    'z1 tp2 cp2:ring',
    'pp2:interleaved cp2:allgather moe ep2',
    'dp2 cp2:ring moe ep4',
    'dp2 z3 tp2 rc',
    'z1 pp2:dualpipev cp2:allgather bf16',
    'z2 cp2:ring moe rcs',
    'pp2:dualpipe',
    'pp2:1f1b moe',
    'dp2 z1 tp2 sp moe ep2 rcs',
    'dp2 z2 cp2:allgather moe ep4 rc',
    'z2 tp2 cp2:allgather moe ep2',
    'tp2 sp pp2:zb-h2 moe',
    'tp2 pp2:interleaved moe',
    'dp4 z2 tp2 sp moe ep4 bf16',
    'z1 pp4:zb-h2 cp2:allgather moe ep2',
    'dp4 z1 tp2 moe ep4 rcs',
    'dp4 rc',
    'z3 cp2:ring moe ep2 bf16 rcs',
    'tp2 sp pp2:dualpipev moe',
    'z1 pp4:zb-h1 cp2:ring rc',
    'z1 tp2 sp pp2:zb-v cp2:ring moe ep2',
    'dp2 z3 moe',
    'z1 tp2 sp pp2:zb-h1 cp2:allgather moe ep2',
    'z1 tp2 sp pp2:interleaved cp2:ring moe ep2',
    'z1 tp2 sp pp2:gpipe cp2:ring moe ep2',
    'z1 tp2 sp pp2:1f1b cp2:ring moe ep2',
    'z1 tp2 pp2:zb-v cp2:allgather moe ep2',
    'z1 tp2 pp2:gpipe cp2:allgather moe ep2',
    'z1 tp2 pp2:dualpipev cp2:ring moe ep2',
    'z1 tp2 pp2:1f1b cp2:allgather moe ep2',
    'tp2 sp pp4:dualpipe bf16',
    'tp2 pp4:zb-h2 moe',
    'tp2 pp2:dualpipe cp2:ring',
    'dp4 z3 cp2:ring moe ep2',
    'dp4 z3 cp2:allgather moe',
    'dp4 z1 pp2:zb-v moe ep4',
    'pp2:dualpipe cp2:allgather rcs',
    'tp2 pp2:zb-h1 moe',
    'dp2 z1 pp4:zb-h2 rcs',
    'dp2x2 z3 moe ep2',
    'dp2x2 z2 rc',
    'dp2x2 z1 moe bf16',
    'dp2x2 z3 cp2:ring moe ep4',
    'dp2x2 z3 tp2 sp rcs',
    'dp2x2 z3 tp2 moe ep2',
    'dp2x2 z3 cp2:allgather moe ep4',
    'dp2x2 z1 pp2:zb-v moe ep2',
    'dp2 z3 pp2:dualpipe',
    'z2 pp2:zb-v cp2:ring moe ep2',
    'z3 pp4:zb-h2 cp2:ring moe ep2',
    'dp2 z2 pp4:1f1b',
)

MLA_ROWS: tuple[str, ...] = (
    'dp2 z3 tp2 sp mla rc',
    'z1 pp2:zb-h1 cp2:ring mla bf16',
    'tp2 cp2:allgather mla moe ep2 rcs',
)

LONG_CONTEXT_ROWS: tuple[str, ...] = (
    'z3 tp2 sp cp2:a2a moe ep2',
    'pp2:zb-v cp2:a2a rc',
    'dp2 z1 cp4:hierarchical/2 rcs',
    # hierarchical beside tp + SP (heads split by tp, then by the all-to-all groups)
    'tp2 sp cp4:hierarchical/2',
)

# async tensor parallel (`atp`: sequence parallel's all-gather and reduce-scatter as rings
# of partial matmuls) beside ZeRO-3 with selective recompute, and inside a split-backward
# pipeline: by hand, as the long-context rows (not a factor of the cover)
ASYNC_TP_ROWS: tuple[str, ...] = (
    'dp2 z3 tp2 sp atp rcs',
    'tp2 sp pp2:zb-v atp moe',
)
# what changes the computation beside the layouts that meet it most: packed documents
# (a document's mask and positions) under ZeRO-3, tp + SP and ring context parallel (each
# rank's chunk of a sequence holds pieces of documents) and under a split-backward pipeline
# (dense: the reference's balance loss is per forward, a document's is not);
# float8 GEMMs under tp + SP (amaxes all-reduced over tp) with ZeRO-1 and selective
# recompute; compilation beside ZeRO-3 (the gather around a compiled block), tp + SP and
# a pipeline
RECIPE_ROWS: tuple[str, ...] = (
    'dp2 z3 tp2 sp cp2:ring docs',
    'pp2:zb-v cp2:allgather docs rc',
    'dp2 z1 tp2 sp fp8 rcs',
    'dp2 z3 tp2 sp cmp',
)
# DualPipe's overlapped F&B pairs (`ofb`): MoE with ep over dp and ZeRO-1 (the all-to-alls
# interleaved), and dense (a pair without all-to-alls runs its sides in turn)
OVERLAP_FB_ROWS: tuple[str, ...] = (
    'dp2 z1 pp2:dualpipev moe ep2 ofb',
    'pp2:dualpipe ofb',
)
ALL_ROWS = ROWS + MLA_ROWS + LONG_CONTEXT_ROWS + ASYNC_TP_ROWS + RECIPE_ROWS + OVERLAP_FB_ROWS
# hand-picked rows whose checks run in the slow tier (`make test-slow`): 8 ranks, or a
# compilation (its first step alone costs a minute on two cores)
SLOW_ROWS = {'tp2 sp cp4:hierarchical/2', 'dp2 z3 tp2 sp cmp'}


def parse(row: str) -> dict:
    """A row's settings by factor, its schedule, and the config `sets` it stands for."""
    tokens = row.split()
    levels = {"dp": "dp1", "zero": "z0", "tp": "tp1", "pp": "pp1", "cp": "cp1",
              "ep": "dense", "precision": "fp64", "recompute": "rc:none"}
    sets: list[str] = []
    schedule = None
    moe = "moe" in tokens
    for tok in tokens:
        if tok in ("moe", "sp", "mla"):
            continue
        if tok in RECIPES:  # what the reference runs too (`model`)
            continue
        if tok.startswith("dp") and "x" in tok:
            levels["dp"] = tok
            shard, replicate = tok[2:].split("x")
            sets += [f"parallel.dp_shard={shard}", f"parallel.dp_replicate={replicate}"]
        elif tok.startswith("dp"):
            levels["dp"] = tok
            sets.append(f"parallel.dp={tok[2:]}")
        elif tok[0] == "z":
            levels["zero"] = tok
            sets.append(f"parallel.zero={tok[1:]}")
        elif tok.startswith("tp"):
            levels["tp"] = tok + ("+sp" if "sp" in tokens else "")
            sets += [f"parallel.tp={tok[2:]}", f"parallel.sp={'sp' in tokens}".lower()]
        elif tok.startswith("pp"):
            size, schedule = tok[2:].split(":")
            levels["pp"] = f"pp{size}"
            sets += [f"parallel.pp={size}", f"parallel.schedule={schedule}"]
        elif tok.startswith("cp"):
            size, mode = tok[2:].split(":")
            levels["cp"] = tok
            mode, _, degree = mode.partition("/")  # hierarchical/A: all-to-all groups of A
            sets += [f"parallel.cp={size}", f"parallel.cp_mode={mode}",
                     *([f"parallel.cp_a2a={degree}"] if degree else [])]
        elif tok.startswith("ep"):
            levels["ep"] = f"moe {tok}"
            sets.append(f"parallel.ep={tok[2:]}")
        elif tok == "bf16":
            levels["precision"] = tok
            sets.append("train.precision=bf16")
        elif tok == "rc":
            levels["recompute"] = "rc:full"
            sets.append("train.recompute=full")
        elif tok == "rcs":
            levels["recompute"] = "rc:selective"
            sets.append("train.recompute=selective")
        elif tok == "atp":
            sets.append("parallel.async_tp=true")
        elif tok == "cmp":
            sets += COMPILE
        elif tok == "ofb":
            sets.append("parallel.overlap_fb=true")
        else:
            raise ValueError(f"matrix row {row!r}: unknown token {tok!r}")
    if moe and levels["ep"] == "dense":
        levels["ep"] = "moe ep1"
    dp, pp = dp_size(levels["dp"]), int(levels["pp"][2:])
    # pipelines take 4 micro-batches where a replica's 8/dp sequences allow it (schedules
    # need m >= pp, dualpipev 2pp - 1); without a pipeline 2, to exercise accumulation
    micro = min(4, 8 // dp) if pp > 1 else 2
    sets.append(f"parallel.microbatches={micro}")
    model = (*(MOE if moe else DENSE), *(MLA if "mla" in tokens else ()),
             *(x for tok in tokens for x in RECIPES.get(tok, ())))
    return {"levels": levels, "schedule": schedule, "model": model, "sets": (*model, *sets)}


def pairs(levels: dict[str, str], schedule: str | None = None) -> set[tuple[str, str]]:
    """The pairs of levels one layout covers (factors in FACTORS order); a pipeline's
    schedule pairs with the levels of SCHEDULE_PAIRS too (the schedule is a factor of the
    pp > 1 layouts only)."""
    names = list(FACTORS)
    out = {(levels[a], levels[b]) for a, b in itertools.combinations(names, 2)}
    if schedule is not None:
        out |= {(schedule, levels[a]) for a in SCHEDULE_PAIRS}
    return out


def row_of(levels: dict[str, str], schedule: str | None) -> str:
    """The notation of a layout given by its levels (the inverse of `parse`)."""
    toks = []
    for factor, default in (("dp", "dp1"), ("zero", "z0")):
        if levels[factor] != default:
            toks.append(levels[factor])
    if levels["tp"] != "tp1":
        toks += ["tp2", "sp"] if levels["tp"] == "tp2+sp" else ["tp2"]
    if levels["pp"] != "pp1":
        toks.append(f"{levels['pp']}:{schedule}")
    if levels["cp"] != "cp1":
        toks.append(levels["cp"])
    if levels["ep"] != "dense":
        toks += ["moe"] + ([levels["ep"].split()[1]] if levels["ep"] != "moe ep1" else [])
    if levels["precision"] == "bf16":
        toks.append("bf16")
    if levels["recompute"] != "rc:none":
        toks.append("rc" if levels["recompute"] == "rc:full" else "rcs")
    return " ".join(toks)


def validity(row: str) -> list[str]:
    """What `Config.validate` says of a row at its world size (empty: it runs), plus the
    matrix's own rule: ZeRO needs ranks to shard over (dp * cp > 1)."""
    from helpers import config

    p = parse(row)
    cfg = config(*p["sets"], f"train.steps={STEPS}")
    world = cfg.parallel.world_size
    if world > 8:
        return [f"world size {world} > 8 (this machine's limit for the suite)"]
    problems = cfg.validate(world)
    if cfg.parallel.zero and cfg.parallel.dp * cfg.parallel.cp == 1:
        problems.append("ZeRO with dp * cp = 1 has no ranks to shard over")
    return problems


def all_layouts() -> Iterable[tuple[dict, str | None]]:
    """Every combination of levels, with each schedule for pp > 1."""
    names = list(FACTORS)
    for combo in itertools.product(*FACTORS.values()):
        levels = dict(zip(names, combo, strict=True))
        if _levels_world(levels) > 8:  # refused by `validity` anyway: skip the parse
            continue
        for schedule in (SCHEDULES if levels["pp"] != "pp1" else (None,)):
            yield levels, schedule


def valid_rows() -> list[str]:
    return [r for r in (row_of(lv, s) for lv, s in all_layouts()) if not validity(r)]


def coverable_pairs(rows: Iterable[str]) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    for r in rows:
        p = parse(r)
        out |= pairs(p["levels"], p["schedule"])
    return out


def greedy_cover(candidates: list[str]) -> list[str]:
    """Rows until every coverable pair and every schedule is in one: each pick covers the
    most new pairs (a new schedule counts as one) per unit of the suite's time, a row's
    taken as (COST_FIXED + its world size) x its recompute's and precision's costs (the
    weighted greedy set cover, Chvatal 1979);
    ties to the smaller world, then to the text (deterministic)."""
    need = coverable_pairs(candidates)
    info, cost = {}, {}
    for r in candidates:
        p = parse(r)
        lv, world = p["levels"], _levels_world(p["levels"])
        info[r] = (pairs(lv, p["schedule"]), p["schedule"], world)
        cost[r] = ((COST_FIXED + world) * RECOMPUTE_COST[lv["recompute"]]
                   * PRECISION_COST[lv["precision"]])
    chosen: list[str] = []
    schedules_left = set(SCHEDULES)
    while need or schedules_left:
        def gain(r: str, need: set = need, left: set = schedules_left) -> tuple:
            ps, sched, world = info[r]
            return ((len(ps & need) + (sched in left)) / cost[r], -world, r)
        best = max(candidates, key=gain)
        chosen.append(best)
        need -= info[best][0]
        schedules_left.discard(info[best][1])
    return chosen


def dp_size(level: str) -> int:
    """dp of a level: "dp4" is 4, "dp2x2" (shard x replicate) 4."""
    return math.prod(int(n) for n in level[2:].split("x"))


def _levels_world(lv: dict[str, str]) -> int:
    return (dp_size(lv["dp"]) * int(lv["tp"][2]) * int(lv["pp"][2:])
            * int(lv["cp"][2]))



if __name__ == "__main__":
    sys.path.insert(0, "tests")
    cands = valid_rows()
    print(f"# {len(cands)} valid layouts", file=sys.stderr)
    for r in greedy_cover(cands):
        print(f"    {r!r},")
