"""Stragglers named: each rank's compute and wait per step, and the rank that is
persistently slower than its peers (rank, node, by how much).

A rank's *wait* in a step is the seconds it was blocked in collectives (the ledger's
exposed time, `CommRecord.blocked`, summed over the step's records); its *compute* is the
rest of its step time. Collectives synchronise the ranks, so every rank's step takes about
as long as the slowest one's: step time names nobody. The slow rank's extra time is
compute on that rank and wait on its peers, which sit in the next collective until it
arrives: the straggler is the rank that computes most and waits least.

After each step every rank's (compute, wait) travel in one all-gather over every rank
(two float64s a rank, tag "metrics": a control collective the planner's byte comparison
leaves out, plait/ledger.py CONTROL_TAGS), so every rank holds every rank's figures and
reaches the same verdict.

The rule (`StragglerRule`):
- a rank's peers are the other ranks of its pipeline stage (the same pp coordinate):
  different stages do different work;
- it is *slow* in a step when its compute exceeds the median of its peers' compute (the
  rank itself left out, so that it cannot pull the reference up) by both `relative`
  (a ratio above 1) and `absolute_s` (seconds): the relative margin scales with the step,
  the absolute one keeps a small step's scheduling jitter (a few ms on a shared CPU) from
  counting;
- it is *named* once it has been slow `steps` steps in a row, and for as long as it stays
  slow; one step that is not slow clears its streak.

On CUDA a collective's wait is on the device stream (NCCL's `wait()` returns to the host at
once), so the ledger's blocked seconds, host time, miss it: there wait_s is only what the
host waited, compute_s is nearly the step time on every rank, and the rule, which needs a
rank's compute above its peers', names nobody. The figures are exact on CPU/gloo.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from plait import comm
from plait.comm import Handle
from plait.ledger import CommRecord, FlightEntry
from plait.mesh import ParallelMesh


@dataclass(frozen=True)
class StragglerRule:
    """When a rank is named (module doc): slow by both margins, `steps` steps in a row."""

    relative: float = 1.2  # compute above 1.2 x the peers' median ...
    absolute_s: float = 0.02  # ... and above it by 20 ms
    steps: int = 5  # in 5 consecutive steps

    def slow(self, compute: float, reference: float | None) -> float | None:
        """compute / reference (the peers' median) where it is above it by both margins;
        None where it is not (or there is no peer to compare with)."""
        if reference is None or reference <= 0 or compute <= reference * self.relative \
                or compute - reference <= self.absolute_s:
            return None
        return compute / reference


def peer_medians(values: list[float]) -> list[float | None]:
    """For each value, the median of the others (None with no other): one sort, then the
    middle of the sorted list with that value taken out."""
    n = len(values)
    if n < 2:
        return [None] * n
    order = sorted(range(n), key=values.__getitem__)
    ordered = [values[i] for i in order]
    out: list[float | None] = [None] * n
    m = n - 1  # the others
    for pos, i in enumerate(order):
        def at(k: int, pos: int = pos) -> float:  # the k-th of the others, in order
            return ordered[k if k < pos else k + 1]

        out[i] = (at((m - 1) // 2) + at(m // 2)) / 2
    return out


@dataclass
class Stragglers:
    """The verdicts of one run, kept by every rank alike (they see the same figures).

    `groups`: the ranks of each pipeline stage, the peers of one another; `node_of`:
    a rank's node (the mesh's gpus_per_node)."""

    groups: list[list[int]]
    node_of: list[int]
    rule: StragglerRule = field(default_factory=StragglerRule)
    streak: dict[int, int] = field(default_factory=dict)
    # per rank: the first step's compute and wait, and the sums over the later steps
    first: tuple[list[float], list[float]] | None = None
    sums: tuple[list[float], list[float]] | None = None
    later_steps: int = 0
    named: dict[int, dict] = field(default_factory=dict)  # rank -> the summary's record

    @classmethod
    def for_mesh(cls, mesh: ParallelMesh, rule: StragglerRule | None = None) -> Stragglers:
        stages: dict[int, list[int]] = {}
        for r in range(mesh.world_size):
            stages.setdefault(mesh.coords_of(r)["pp"], []).append(r)
        return cls(list(stages.values()), [mesh.node_of(r) for r in range(mesh.world_size)],
                   rule or StragglerRule())

    def judge(self, step: int, compute: list[float], wait: list[float]) -> dict | None:
        """Record one step's figures (per rank) and return the verdict for it: the named
        rank slowest against its peers, as the metrics row's "straggler", or None."""
        self._add(compute, wait)
        verdicts = []
        for ranks in self.groups:
            mine = [compute[r] for r in ranks]
            for r, c, reference in zip(ranks, mine, peer_medians(mine), strict=True):
                ratio = self.rule.slow(c, reference)
                self.streak[r] = self.streak.get(r, 0) + 1 if ratio is not None else 0
                if ratio is not None and self.streak[r] >= self.rule.steps:
                    verdicts.append(self._name(step, r, ratio))
        return max(verdicts, key=lambda v: v["slower_by"], default=None)

    def _add(self, compute: list[float], wait: list[float]) -> None:
        if self.first is None:
            self.first = (list(compute), list(wait))
            return
        if self.sums is None:
            self.sums = ([0.0] * len(compute), [0.0] * len(wait))
        for total, figures in zip(self.sums, (compute, wait), strict=True):
            for r, x in enumerate(figures):
                total[r] += x
        self.later_steps += 1

    def _name(self, step: int, rank: int, ratio: float) -> dict:
        verdict = {"rank": rank, "node": self.node_of[rank], "slower_by": ratio,
                   "steps": self.streak[rank]}
        seen = self.named.setdefault(rank, {"rank": rank, "node": self.node_of[rank],
                                            "first_step": step, "slower_by": ratio,
                                            "steps": 0})
        seen["slower_by"] = max(seen["slower_by"], ratio)
        seen["steps"] = max(seen["steps"], self.streak[rank])
        return verdict

    def summary(self) -> dict:
        """Per rank, the mean compute and wait per step (the first step, which warms
        caches, left out when there are others: plait/throughput.py), and every rank
        named, with its worst ratio and longest streak."""
        if self.sums is not None:
            compute, wait = ([x / self.later_steps for x in t] for t in self.sums)
        else:
            compute, wait = self.first or ([], [])
        return {"compute_s_per_rank": compute, "wait_s_per_rank": wait,
                "named": [self.named[r] for r in sorted(self.named)],
                "rule": {**asdict(self.rule), "peers": "the ranks of the same pipeline stage"}}


def wait_seconds(records: list[CommRecord]) -> float:
    """Seconds this rank was blocked in the step's collectives (their exposed time)."""
    return sum(r.blocked for r in records)


class Exchange:
    """Every rank's figures, one step behind: each step's all-gather is issued async after
    the step and completed after the next one, so it never holds a rank back (a blocking
    one would be a barrier over every rank at each step's end: the pipeline's cross-step
    overlap and post-validation's unsynchronised step ends gone).

    While it runs behind a step, its flight-recorder entry reads done, and it is opened
    again, timed from then, only while the rank waits for it: the hang watchdog
    (plait/launch/watchdog.py) times a rank's waits, not an exchange in the background."""

    def __init__(self) -> None:
        self.mesh: ParallelMesh | None = None  # the run's, from its first step on
        self.stragglers: Stragglers | None = None
        self._pending: tuple[int, Handle | None, torch.Tensor, FlightEntry | None] | None = \
            None

    def send(self, mesh: ParallelMesh, step: int, compute: float, wait: float) -> None:
        """Issue step `step`'s exchange (collective over every rank)."""
        if self.mesh is None:
            self.mesh, self.stragglers = mesh, Stragglers.for_mesh(mesh)
        mine = torch.tensor([compute, wait], dtype=torch.float64, device=mesh.device.torch)
        every = torch.zeros(2 * mesh.world_size, dtype=torch.float64, device=mesh.device.torch)
        handle = comm.all_gather(every, mine, mesh, "world", async_op=True, tag="metrics")
        entry = mesh.ledger.flight[-1] if mesh.world_size > 1 else None  # one rank: no call
        if entry is not None:
            entry.done = True  # in the background (class doc)
        self._pending = (step, handle, every, entry)

    def collect(self) -> dict | None:
        """Complete the exchange in flight and judge its step: the verdict (with the
        judged step), or None (no exchange in flight, or nobody named)."""
        if self._pending is None:
            return None
        step, handle, every, entry = self._pending
        self._pending = None
        if entry is not None:  # the rank waits for it from now
            entry.done, entry.entered = False, time.perf_counter()
        if handle is not None:
            handle.wait()
        figures = every.view(len(every) // 2, 2).tolist()
        assert self.stragglers is not None  # set with the exchange in flight
        verdict = self.stragglers.judge(step, [f[0] for f in figures], [f[1] for f in figures])
        return None if verdict is None else {**verdict, "step": step}

    def finish(self) -> dict:
        """After the last step: its exchange completed and judged; the summary's
        "stragglers" (`Stragglers.summary`; empty where no step ran). Collective over
        every rank."""
        self.collect()
        if self.stragglers is None:
            return Stragglers([], []).summary()
        self.mesh = None  # the run is over: its process groups are not held here
        return self.stragglers.summary()


def observe_step(row: dict, mesh: ParallelMesh, exchange: Exchange) -> None:
    """After a step (every rank, at the same point): this rank's compute and wait into
    `row` ("compute_s", "wait_s"), and the verdict on the step before, from every rank's
    figures ("straggler", absent when nobody is named). Collective over every rank."""
    wait = wait_seconds(mesh.ledger.for_step(row["step"]))
    compute = max(row["step_time"] - wait, 0.0)
    row.update(compute_s=compute, wait_s=wait)
    verdict = exchange.collect()
    if verdict is not None:
        row["straggler"] = verdict
    exchange.send(mesh, row["step"], compute, wait)


def straggler_text(verdict: dict) -> str:
    """'rank 3 (node 1) 2.10x its peers' compute, 4 steps in a row'."""
    return (f"rank {verdict['rank']} (node {verdict['node']}) {verdict['slower_by']:.2f}x "
            f"its peers' compute, {verdict['steps']} steps in a row")
