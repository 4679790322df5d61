"""The split sequence's attention modes (plait/parallel/context.py) priced side by side on
one layout, and the planner's choice among them: per mode the bytes a rank sends per step
over NVLink and across nodes, the memory of the most loaded rank, the exposed exchange
and the step time (`evaluate` with the pipeline simulated: the call the search's shown
layouts come from, so a layout's price here is its table row's; the same formulas the
ledger is checked against); the choice is the fastest mode that fits.

Memory is the same formula for every mode (activations at s/n tokens a rank, n the
sequence's ranks): what a mode holds only during one layer's attention (the all-gather's
whole-sequence K/V, the all-to-all's whole sequence of h/n heads) is transient, and the
planner's peak is the saved activations.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from plait.dims import BY_NAME, DIMENSIONS
from plait.plan.basis import Layout, Training
from plait.plan.compute import Efficiency
from plait.plan.estimate import evaluate
from plait.plan.hardware import Cluster
from plait.plan.shape import Shape

SEQ = next(d.name for d in DIMENSIONS if d.splits == "sequence")
MODES = next(s.choices for s in BY_NAME[SEQ].settings if s.key.endswith("_mode"))


@dataclass
class ModePrice:
    mode: str
    degree: int  # the hierarchical mode's all-to-all group (1 otherwise)
    step_time: float
    exposed: float  # seconds a step of the sequence's exchange not hidden behind compute
    memory: float  # bytes on the most loaded rank
    fits: bool
    bytes_intra: float  # a rank's payload per step over NVLink
    bytes_inter: float  # ... and across nodes
    problem: str = ""  # why the mode cannot run this layout (then nothing is priced)


def node_degree(n: int, tp: int, gpus_per_node: int) -> int:
    """The hierarchical all-to-all group: the largest divisor of n beside tp in a node."""
    fit = max(gpus_per_node // max(tp, 1), 1)
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= fit)


def price_modes(shape: Shape, cluster: Cluster, train: Training, lay: Layout,
                eff: Efficiency) -> list[ModePrice]:
    """Every mode on `lay` (scalar sizes), each through `evaluate` with the pipeline
    simulated, the call that prices the layouts `plait plan` shows."""
    n, tp = int(lay.sizes[SEQ]), int(lay.sizes["tp"])
    heads = shape.heads // tp
    out = []
    for mode in MODES:
        degree = node_degree(n, tp, cluster.gpus_per_node) if mode == "hierarchical" else 1
        group = {"a2a": n, "hierarchical": degree}.get(mode, 1)
        if heads % group:
            out.append(ModePrice(mode, degree, 0, 0, 0, False, 0, 0,
                                 f"{heads} heads a tp rank do not split {group} ways"))
            continue
        one = copy.copy(lay)
        one.cp_mode, one.cp_a2a = mode, degree
        # priced as the search prices the layouts it shows (their pipeline simulated), so
        # the layout's own mode gets the price its table row has
        e = evaluate(shape, cluster, train, one, eff, simulate=True)
        mine = [c for c in e.collectives if c.dim.split("_")[0] == SEQ]
        by_link = {True: 0.0, False: 0.0}
        for c in mine:
            by_link[bool(c.intra)] += float(c.size * c.count)
        out.append(ModePrice(mode, degree, float(e.step_time),
                             float(sum(c.exposed for c in mine)), float(e.memory_total),
                             bool(e.fits), by_link[True], by_link[False]))
    return out


def choose(prices: list[ModePrice]) -> ModePrice | None:
    """The fastest mode that fits (None: none does)."""
    ok = [p for p in prices if not p.problem and p.fits]
    return min(ok, key=lambda p: p.step_time) if ok else None


def mode_notes(shape: Shape, cluster: Cluster, train: Training, lay: Layout,
               eff: Efficiency) -> list[str]:
    """`plait plan`'s words on the layout's mode (nothing when the sequence is whole): the
    one chosen, and each mode's step time and bytes a rank sends a step across nodes."""
    if int(lay.sizes[SEQ]) == 1:
        return []
    prices = price_modes(shape, cluster, train, lay, eff)
    pick = choose(prices)
    each = "; ".join(
        f"{p.mode}: refused ({p.problem})" if p.problem else
        f"{p.mode}{f' (all-to-all groups of {p.degree})' if p.mode == 'hierarchical' else ''}"
        f": {p.step_time:.3f} s, {p.bytes_inter / 1e9:.1f} GB across nodes"
        f"{'' if p.fits else ', does not fit'}" for p in prices)
    flags = {s.key: s.flag for s in BY_NAME[SEQ].settings}
    head = "Context parallel mode: none fits"
    if pick is not None:
        degree = (f" {flags[SEQ + '_a2a']} {pick.degree}" if pick.mode == "hierarchical"
                  else "")
        head = (f"Context parallel mode: {pick.mode} is the fastest that fits "
                f"({flags[SEQ + '_mode']} {pick.mode}{degree})")
    return [f"{head}; {each}. (The search scores ring layouts; the mode is priced on the "
            "best one.)"]
