"""The pipeline IR: a schedule is a list of actions per rank.

The same data is checked (`check.py`), simulated (`simulate.py`), drawn (`draw.py`) and,
later, executed by the runtime. Nothing here knows about tensors or processes.

Stages. A schedule has `num_stages` (S) *virtual stages*, numbered 0..S-1, and a
`stage_to_rank` placement. Stages form `num_chains` independent chains of equal length
L = S / num_chains: chain c is stages c*L .. c*L+L-1, and a micro-batch's forward runs
down its chain (s -> s+1), its backward back up (s+1 -> s). Every schedule but DualPipe
has one chain. DualPipe has two: chain 0 (stages 0..p-1, stage j on rank j) carries
micro-batches 0..m/2-1 "down", chain 1 (stages p..2p-1, stage p+j on rank p-1-j) carries
micro-batches m/2..m-1 "up"; stage c*L+j computes layer block j of the model
(`model_stage`), so each rank holds two copies' worth of blocks, as in DeepSeek-V3.

Actions. `F` forward, `B` full backward, `I` backward w.r.t. the stage input, `W` backward
w.r.t. the weights (B = I then W; Qi et al. 2023). Lowering (`lower.py`) adds
`SEND_F`/`RECV_F` (activations) and `SEND_B`/`RECV_B` (input gradients), each naming the
peer rank. The `stage` of a transfer is the stage of the action on *this* rank: SEND_F s
ships the output of F s, RECV_F s brings the input of F s; SEND_B s ships the gradient
produced by I/B s, RECV_B s brings the gradient that I/B s consumes.

Text form (`to_text`/`from_text`), CSV-like, one line per rank::

    schedule,1f1b,pp=2,microbatches=2,virtual_stages=1,num_stages=2,num_chains=1
    stage_to_rank,0,1
    0,F0.0,F0.1,B0.0,B0.1
    1,F1.0,B1.0,F1.1,B1.1

`F0.3` is forward of stage 0 for micro-batch 3; transfers read `SEND_F0.3>1` (to rank 1)
and `RECV_F1.3<0` (from rank 0).
"""

from __future__ import annotations

import functools
import gc
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from operator import itemgetter
from typing import NamedTuple, TypeVar

COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMM

_ACTION_RE = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)\.(\d+)(?:([<>])(\d+))?$")


class _ActionFields(NamedTuple):
    kind: str
    stage: int
    microbatch: int
    peer: int | None = None  # the other rank of a transfer; None for compute


class Action(_ActionFields):
    """One action: `(kind, stage, microbatch, peer)`. A tuple, so that a schedule of a
    million actions builds and unpacks fast; `Action(...)` checks its fields, `trusted`
    (for builders whose kinds are literals) does not."""

    __slots__ = ()

    def __new__(cls, kind: str, stage: int, microbatch: int, peer: int | None = None):
        if kind not in KINDS:
            raise ValueError(f"action kind {kind!r}; use one of {', '.join(KINDS)}")
        if (peer is None) != (kind in COMPUTE):
            raise ValueError(f"{kind} needs peer={'None' if kind in COMPUTE else 'a rank'}")
        return _new_tuple(cls, (kind, stage, microbatch, peer))

    @property
    def is_comm(self) -> bool:
        return self[0] in COMM

    def __str__(self) -> str:
        kind, stage, mb, peer = self
        s = f"{kind}{stage}.{mb}"
        if kind.startswith("SEND"):
            s += f">{peer}"
        elif kind.startswith("RECV"):
            s += f"<{peer}"
        return s

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. F0.3 or SEND_F0.3>1")
        kind, stage, mb, arrow, peer = m.groups()
        if (arrow == ">" and not kind.startswith("SEND")) or (
            arrow == "<" and not kind.startswith("RECV")
        ):
            raise ValueError(f"action {text!r}: sends use '>peer', receives use '<peer'")
        return cls(kind, int(stage), int(mb), None if peer is None else int(peer))


_new_tuple = tuple.__new__
_ROW_RE = re.compile(r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)\.(\d+)(?:([<>])(\d+))?")


def _parse_row(tokens: list[str]) -> list[Action]:
    """`Action.parse` of each non-empty token, in one regex pass over the row when every
    token is well formed (a million-action schedule loads in seconds); otherwise token by
    token, so that the first bad one is named as `Action.parse` names it."""
    tokens = [t for t in tokens if t]
    out = []
    for t in tokens:
        m = _ROW_RE.fullmatch(t)
        if m is None:
            break
        kind, stage, mb, arrow, peer = m.groups()
        if (arrow == ">") != (kind[0] == "S") or (arrow == "<") != (kind[0] == "R"):
            break
        out.append(_new_tuple(Action, (kind, int(stage), int(mb),
                                       None if peer is None else int(peer))))
    else:
        return out
    return [Action.parse(t) for t in tokens]
_F = TypeVar("_F", bound=Callable)


def without_gc(fn: _F) -> _F:
    """Run `fn` with Python's cycle collector paused. A schedule is up to millions of
    small tuples and lists and no cycles; the collector would rescan them all, again and
    again as they accumulate, for nothing (half the time of building 1F1B at p=64,
    m=1024)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper  # type: ignore[return-value]


def trusted(kind: str, stage: int, microbatch: int, peer: int | None = None) -> Action:
    """An `Action` without the field checks: for builders and lowering, whose kinds and
    peers are right by construction (5x faster than `Action(...)`)."""
    return _new_tuple(Action, (kind, stage, microbatch, peer))


@dataclass
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    num_stages: int
    stage_to_rank: list[int]
    actions: list[list[Action]]  # actions[rank] in execution order
    num_chains: int = 1
    lowered: bool = field(default=False)
    # lowered with each F directly followed by an I/B of another micro-batch run as one
    # overlapped pair (`lower(..., pair_fb=True)`, `fb_pairs`)
    paired_fb: bool = field(default=False)

    def __post_init__(self) -> None:
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for "
                f"num_stages={self.num_stages}"
            )
        if len(self.actions) != self.pp:
            raise ValueError(f"{len(self.actions)} action lists for pp={self.pp}")
        if self.paired_fb and not self.lowered:
            raise ValueError("paired_fb marks a lowered schedule; lower it with pair_fb=True")
        if self.num_stages % self.num_chains or self.microbatches % self.num_chains:
            raise ValueError(
                f"num_chains={self.num_chains} must divide num_stages={self.num_stages} "
                f"and microbatches={self.microbatches}"
            )

    # --- stage topology -------------------------------------------------------------
    @property
    def chain_length(self) -> int:
        return self.num_stages // self.num_chains

    def chain_of_stage(self, stage: int) -> int:
        return stage // self.chain_length

    def chain_of_microbatch(self, mb: int) -> int:
        return mb // (self.microbatches // self.num_chains)

    def stages_of(self, mb: int) -> range:
        """The stages micro-batch `mb` passes through, in forward order."""
        c = self.chain_of_microbatch(mb)
        return range(c * self.chain_length, (c + 1) * self.chain_length)

    def microbatches_of(self, stage: int) -> range:
        per = self.microbatches // self.num_chains
        c = self.chain_of_stage(stage)
        return range(c * per, (c + 1) * per)

    def next_stage(self, stage: int) -> int | None:
        """Where F's output goes; None at the end of a chain (the loss)."""
        return None if (stage + 1) % self.chain_length == 0 else stage + 1

    def prev_stage(self, stage: int) -> int | None:
        """Where I/B's gradient goes; None at the start of a chain (the embedding)."""
        return None if stage % self.chain_length == 0 else stage - 1

    def model_stage(self, stage: int) -> int:
        """Which block of layers the stage computes (differs from `stage` for DualPipe)."""
        return stage % self.chain_length

    def stages_on(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    # --- text round-trip ------------------------------------------------------------
    def to_text(self) -> str:
        head = (
            f"schedule,{self.name},pp={self.pp},microbatches={self.microbatches},"
            f"virtual_stages={self.virtual_stages},num_stages={self.num_stages},"
            f"num_chains={self.num_chains},lowered={int(self.lowered)}"
        ) + (",paired_fb=1" if self.paired_fb else "")
        lines = [head, "stage_to_rank," + ",".join(map(str, self.stage_to_rank))]
        for r, acts in enumerate(self.actions):
            lines.append(",".join([str(r)] + [str(a) for a in acts]))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
        if len(lines) < 2 or not lines[0].startswith("schedule,"):
            raise ValueError("schedule text must start with a 'schedule,<name>,key=value' header")
        head = lines[0].split(",")
        meta = dict(kv.split("=", 1) for kv in head[2:])
        if not lines[1].startswith("stage_to_rank,"):
            raise ValueError("second line must be 'stage_to_rank,<rank>,<rank>,...'")
        stage_to_rank = [int(x) for x in lines[1].split(",")[1:]]
        pp = int(meta["pp"])
        actions: list[list[Action]] = [[] for _ in range(pp)]
        for ln in lines[2:]:
            rank, *acts = ln.split(",")
            r = int(rank)
            if not 0 <= r < pp:
                raise ValueError(f"rank {r} out of range for pp={pp}")
            actions[r] = _parse_row(acts)
        return cls(
            name=head[1],
            pp=pp,
            microbatches=int(meta["microbatches"]),
            virtual_stages=int(meta.get("virtual_stages", 1)),
            num_stages=int(meta.get("num_stages", len(stage_to_rank))),
            stage_to_rank=stage_to_rank,
            actions=actions,
            num_chains=int(meta.get("num_chains", 1)),
            lowered=bool(int(meta.get("lowered", 0))),
            paired_fb=bool(int(meta.get("paired_fb", 0))),
        )


def peak_activations(schedule: Schedule, until: str = "I") -> list[int]:
    """Per rank, the most stage-micro-batch activation sets held at once: +1 when an F runs,
    -1 when its I or B finishes (`until` "I"), or its W or B (`until` "W"). After I, a W
    still holds the inputs of its weight-gradient matmuls (layer inputs and output
    gradients, nearly all of it: Qi et al. 2023, Table 1); "I" does not count that
    residue, "W" counts it whole, as the paper's memory bounds do. The unit is one stage's
    activations for one micro-batch: with v stages per rank a unit is 1/v of what a 1F1B
    unit (a whole rank's layers) holds."""
    live = _LIVE if until == "I" else _HELD
    # the running count's maximum, in C (map, accumulate, max): no Python step per action
    return [max(accumulate(map(live.__getitem__, map(_KIND, acts)), initial=0))
            for acts in schedule.actions]


_LIVE = {k: 1 if k == "F" else -1 if k in ("I", "B") else 0 for k in KINDS}
_HELD = {k: 1 if k == "F" else -1 if k in ("W", "B") else 0 for k in KINDS}
_KIND = itemgetter(0)


def split_backwards(schedule: Schedule, rank: int, recompute: bool
                    ) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """(whole at W, split) (stage, micro-batch) pairs of `rank`'s I/W actions, as the
    runtime runs them (plait/parallel/pipeline/runtime.py): a chain's first stage whose W
    directly follows its I, without recomputation, runs the whole backward in W (its I
    sends nothing); every other I/W pair is split in two autograd passes."""
    computes = [a for a in schedule.actions[rank] if not a.is_comm]
    whole = set() if recompute else {
        (a.stage, a.microbatch) for a, b in zip(computes, computes[1:])
        if a.kind == "I" and b[:3] == ("W", a.stage, a.microbatch)
        and schedule.prev_stage(a.stage) is None}
    split = {(a.stage, a.microbatch) for a in computes
             if a.kind == "I" and (a.stage, a.microbatch) not in whole}
    return whole, split


def pair_starts(computes: list[Action]) -> list[int]:
    """Indices, in a rank's compute order, of the F's directly followed by an I or B of
    another micro-batch: the F&B pairs (`fb_pairs`)."""
    return [i for i, (a, b) in enumerate(zip(computes, computes[1:]))
            if a[0] == "F" and b[0] in ("I", "B") and a[2] != b[2]]


def paired_share(schedule: Schedule) -> float:
    """The least share, over ranks, of a rank's forwards that start an F&B pair: the part
    of its chunks whose all-to-alls the overlapped executor can hide (the planner's)."""
    shares = []
    for acts in schedule.actions:
        computes = [a for a in acts if a[0] in COMPUTE]
        forwards = sum(a[0] == "F" for a in computes)
        shares.append(len(pair_starts(computes)) / forwards if forwards else 0.0)
    return min(shares)


def fb_pairs(schedule: Schedule) -> list[list[int]]:
    """Per rank, the index of each F that runs overlapped with the action after it: in a
    schedule lowered with `pair_fb`, every F directly followed (no transfer between) by an
    I or B of another micro-batch (DualPipe's F&B chunks; the steady phase of 1F1B-like
    orders). The pair starts when both inputs are there and its transfers go after it.
    Empty lists for a schedule lowered without pairing."""
    if not schedule.paired_fb:
        return [[] for _ in schedule.actions]
    return [[i for i, (a, b) in enumerate(zip(acts, acts[1:]))
             if a[0] == "F" and b[0] in ("I", "B") and a[2] != b[2]]
            for acts in schedule.actions]
