"""The communication ledger: every collective this rank takes part in, with its bytes.

Bytes are *algorithmic*: what this rank sends and receives under the ring algorithm for
the op, its payload and the group size (gloo's wire traffic differs: it has no real
reduce-scatter). With S the payload bytes and n the group size (Patarasuk & Yuan 2009;
Stanford CS336, lecture 8 (parallelism): "all-reduce = reduce-scatter + all-gather"):

    all_reduce      2(n-1)/n * S   sent and received (reduce-scatter then all-gather)
    reduce_scatter  (n-1)/n * S    S = the full (unscattered) input
    all_gather      (n-1)/n * S    S = the full (gathered) output
    broadcast       pipelined chain from the root: root sends S, the last receives S,
                    every other rank receives and forwards S
    all_to_all      the splits that leave this rank / arrive from other ranks
    send / recv     S
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field


def ring_bytes(op: str, payload: int, n: int) -> tuple[float, float]:
    """(sent, received) bytes per rank for a ring collective of `payload` bytes on n ranks."""
    if n <= 1:
        return 0.0, 0.0
    if op == "all_reduce":
        b = 2 * (n - 1) / n * payload
    elif op in ("reduce_scatter", "all_gather"):
        b = (n - 1) / n * payload
    else:
        raise ValueError(f"ring_bytes: no ring formula for {op!r}")
    return b, b


@dataclass
class CommRecord:
    op: str
    dim: str
    group_size: int
    payload: int  # bytes of the logical tensor (see module doc for which one)
    sent: float
    received: float
    link: str  # "intra" | "inter" node
    start: float  # perf_counter at issue
    end: float  # perf_counter at completion (wait() for async ops)
    step: int
    tag: str = ""
    dtype: str = ""
    blocked: float = 0.0  # seconds the issuing rank waited for it (exposed)
    # of `sent`, the bytes to ranks on other nodes (all_to_all, whose peers mix links)
    sent_inter: float = 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def hidden(self) -> float:
        """Seconds in flight while the rank did other work (issue to completion, less
        the wait): an async op's overlap; 0 for a synchronous one."""
        return max(self.seconds - self.blocked, 0.0)


FLIGHT_RECORDS = 16  # the flight recorder's length: the last collectives entered


@dataclass
class FlightEntry:
    """A collective as it is entered, for the flight recorder: `done` once it completed
    (its ledger record, written at issue, is timed then). `seq`: this rank's count of
    collectives entered; `dim_seq`: its count on this mesh dim, which the ranks of one
    group share while they are in step (the rank with the lowest `dim_seq` on a dim is
    the one behind)."""

    seq: int
    dim_seq: int
    op: str
    dim: str
    payload: int
    step: int
    tag: str
    entered: float  # perf_counter
    done: bool = False


# The step of collectives that belong to no training step: gathering a full state or the
# first-step gradients for a check. Recorded like any other, left out of per-step totals.
OUTSIDE_STEP = -1


@dataclass
class Ledger:
    records: list[CommRecord] = field(default_factory=list)
    step: int = 0
    # the flight recorder: the last FLIGHT_RECORDS collectives entered, done or not
    # (what a hang report shows; plait/launch/watchdog.py reads it from another thread)
    flight: deque[FlightEntry] = field(default_factory=lambda: deque(maxlen=FLIGHT_RECORDS))
    entered: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # per dim

    def enter(self, op: str, dim: str, payload: int, tag: str = "") -> FlightEntry:
        """A collective is being issued: note it in the flight recorder."""
        self.entered[dim] += 1
        entry = FlightEntry(sum(self.entered.values()), self.entered[dim], op, dim,
                            int(payload), self.step, tag, time.perf_counter())
        self.flight.append(entry)
        return entry

    def in_flight(self) -> list[FlightEntry]:
        """The flight recorder's entries, oldest first (safe from another thread: the
        copy is one C call under the GIL)."""
        for _ in range(3):
            with contextlib.suppress(RuntimeError):  # mutated during the copy: again
                return list(self.flight)
        return []

    def add(self, op: str, dim: str, group_size: int, payload: int, sent: float,
            received: float, link: str, start: float, tag: str = "", dtype: str = "",
            end: float | None = None, blocked: float | None = None,
            sent_inter: float | None = None) -> CommRecord:
        """`blocked` (default: all of it) is the part of issue..end the rank waited;
        `sent_inter` (default: all of `sent` on an inter-node link, else none)."""
        end = time.perf_counter() if end is None else end
        if sent_inter is None:
            sent_inter = sent if link == "inter" else 0.0
        rec = CommRecord(op, dim, group_size, int(payload), float(sent), float(received), link,
                         start, end, self.step, tag, dtype,
                         float(end - start if blocked is None else blocked), float(sent_inter))
        self.records.append(rec)
        return rec

    def clear(self) -> None:
        self.records.clear()

    @contextlib.contextmanager
    def outside_step(self) -> Iterator[None]:
        """Record what runs inside as OUTSIDE_STEP (a check's or a gather's bytes, not a
        training step's), then go back to the current step."""
        saved, self.step = self.step, OUTSIDE_STEP
        try:
            yield
        finally:
            self.step = saved

    def for_step(self, step: int | None = None) -> list[CommRecord]:
        """The records of `step`, or of every training step (not OUTSIDE_STEP's)."""
        if step is None:
            return [r for r in self.records if r.step != OUTSIDE_STEP]
        return [r for r in self.records if r.step == step]

    def summary(self, step: int | None = None) -> dict[str, dict[str, float]]:
        """Totals keyed by "op@dim": count, payload, sent, received, seconds (issue to
        completion), exposed (blocked) and hidden seconds."""
        out: dict[str, dict[str, float]] = defaultdict(
            lambda: {"count": 0, "payload": 0, "sent": 0.0, "received": 0.0, "seconds": 0.0,
                     "exposed": 0.0, "hidden": 0.0, "sent_inter": 0.0})
        for r in self.for_step(step):
            row = out[f"{r.op}@{r.dim}"]
            row["count"] += 1
            row["payload"] += r.payload
            row["sent"] += r.sent
            row["sent_inter"] += r.sent_inter
            row["received"] += r.received
            row["seconds"] += r.seconds
            row["exposed"] += r.blocked
            row["hidden"] += r.hidden
        return dict(out)

    def overlap_by_dim(self, step: int | None = None) -> dict[str, dict[str, float]]:
        """Per mesh dim: communication seconds (issue to completion), exposed (the rank
        waited) and hidden (in flight behind other work)."""
        out: dict[str, dict[str, float]] = defaultdict(
            lambda: {"seconds": 0.0, "exposed": 0.0, "hidden": 0.0})
        for r in self.for_step(step):
            row = out[r.dim]
            row["seconds"] += r.seconds
            row["exposed"] += r.blocked
            row["hidden"] += r.hidden
        return dict(out)

    def totals(self, step: int | None = None) -> dict[str, float]:
        recs = self.for_step(step)
        return {
            "count": len(recs),
            "sent": sum(r.sent for r in recs),
            "received": sum(r.received for r in recs),
            "seconds": sum(r.seconds for r in recs),
            "exposed": sum(r.blocked for r in recs),
        }

    def by_dim(self, step: int | None = None) -> dict[str, float]:
        """Bytes sent per mesh dim."""
        out: dict[str, float] = defaultdict(float)
        for r in self.for_step(step):
            out[r.dim] += r.sent
        return dict(out)

    def to_dicts(self, step: int | None = None) -> list[dict]:
        """Every record (OUTSIDE_STEP's too), or those of `step`."""
        return [asdict(r) for r in (self.records if step is None else self.for_step(step))]


# Collectives that carry no model data: step metrics, the grad-norm sum, MoE's load counts
# and the all-to-all split sizes, float8's amax maxima. The planner models the data
# collectives; these are a few bytes (bounded in the test) and are left out of the
# comparison.
CONTROL_TAGS = ("metrics", "grad_norm", "moe.load", ".counts", "fp8.amax")


def data_bytes_by_dim(records: list[dict]) -> dict[str, float]:
    """One rank's payload bytes per mesh dim in one step, as the planner names the dims:
    a collective's payload, a send's bytes (a receive is the other end's send), control
    collectives left out; the dims are the mesh's group names, which the planner's
    collectives use too (ZeRO and gradient syncs over the replica axes under context
    parallel: "dp_cp"); DualPipe's copy swap is its own line ("pp_copies": its busiest
    rank is an end rank, the sends' a middle one)."""
    out: dict[str, float] = {}
    for r in records:
        if r["op"] == "recv" or is_control(r["tag"]):
            continue
        dim = "pp_copies" if r["tag"] == "pp_copies" else r["dim"]  # DualPipe's swap
        out[dim] = out.get(dim, 0.0) + r["payload"]
    return out


def is_control(tag: str) -> bool:
    return any(tag == t or tag.endswith(t) for t in CONTROL_TAGS)


def control_bytes(records: list[dict]) -> float:
    return sum(r["payload"] for r in records if r["op"] != "recv" and is_control(r["tag"]))
