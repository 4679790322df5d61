"""Fault-tolerant replicas: a step goes on without a replica that died or stopped
answering, and a replacement joins from a live peer.

The data-parallel replica groups of hybrid sharding (plait/dims/dp_replicate.py) become
the unit of failure: each replica (a dp_shard group with every dimension inside it) is a
job of its own (its own process group and launcher, plait/launch/replicas.py), and the only traffic
between replicas is the once-a-step sum of the reduced gradient shards. That sum runs on
a process group of the replicas in the step's *quorum*, made afresh whenever the
membership changes (the design of torchft, Meta's fault-tolerance library: per-step
quorum over replica groups, recovery of a new replica from a live peer).

A step, on each rank (position i of replica r):

1. the replica trains its *slots*: slot k is the k-th of the dp_replicate slices of the
   global batch; every replica owns its own, and a lost replica's slots are handed to the
   survivors (`SlotMap`), so the global batch and the loss curve stay those of the
   uninterrupted run, up to the order of the sums;
2. its gradient shards and partial loss are summed over the quorum's ranks at position i
   (`sum_gradients`), on a copy kept to redo from;
3. each replica agrees on its own outcome (one flag over its ranks) and its leader posts
   it to the job's store; every rank waits for every member's post (`timeout_s`), and the
   first verdict written (an atomic compare-and-set) is every rank's: *commit*, or *redo*
   without the members whose post never came. On a redo each survivor restores its copy,
   trains the slots it was handed and sums again, in a new group: no step is lost;
4. a replacement that asked to join is admitted with a commit: once the step's update is
   done the lowest member (the donor) sends, position by position, everything a
   checkpoint would load (plait/parallel/held.py) straight over the network, and the next
   step runs with it (`hand_over`, `join`).

The store is the launcher's (it outlives every replica); this module only reads what
it is given: no environment, no signals (the CLI layer's).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from plait import comm
from plait.mesh import ParallelMesh

# the first sum of a run waits at least this long: replicas start apart (process launch,
# imports, the model's build), which is not a failure
STARTUP_S = 120.0

# the ledger's name for the sum between replicas: the same bytes hybrid sharding's
# all-reduce over dp_replicate moves, so the planner prices both with one formula
DIM = "dp_replicate"


class ReplicaExcluded(RuntimeError):
    """This replica was left out of the quorum (it answered too late): it stops, and the
    launcher starts a replacement that joins from a live peer."""


@dataclass
class SlotMap:
    """Which replica trains each slice (slot) of the global batch. Every replica starts
    with its own slot; a lost member's slots go to the survivors round-robin, fewest
    first, in a fixed order, so every rank derives the same map from the same verdicts;
    a replica that joins takes its own slot back."""

    owner: dict[int, int]  # slot -> replica

    @classmethod
    def initial(cls, replicas: int) -> SlotMap:
        return cls({k: k for k in range(replicas)})

    def of(self, replica: int) -> list[int]:
        return sorted(k for k, r in self.owner.items() if r == replica)

    def without(self, lost: list[int], members: list[int]) -> SlotMap:
        """The map after `lost` left; `members`: the survivors (non-empty)."""
        owner = dict(self.owner)
        for k in sorted(k for k, r in owner.items() if r in lost):
            load = {m: sum(1 for r in owner.values() if r == m) for m in members}
            owner[k] = min(members, key=lambda m: (load[m], m))
        return SlotMap(owner)

    def joined(self, replica: int) -> SlotMap:
        return SlotMap({**self.owner, replica: replica})


@dataclass
class Epoch:
    """A membership: the replicas summing together, and their slots."""

    number: int
    members: list[int]
    slots: SlotMap
    generations: dict[int, int]  # replica -> its replacements so far (0: the first launch)

    def to_json(self) -> dict:
        return {"epoch": self.number, "members": self.members,
                "slots": {str(k): r for k, r in self.slots.owner.items()},
                "generations": {str(r): g for r, g in self.generations.items()}}

    @classmethod
    def from_json(cls, d: dict) -> Epoch:
        return cls(d["epoch"], list(d["members"]),
                   SlotMap({int(k): r for k, r in d["slots"].items()}),
                   {int(r): g for r, g in d["generations"].items()})


@dataclass
class Event:
    """A membership change, as the summary's `fault_tolerance.events` lists it."""

    kind: str  # "lost" | "joined"
    replicas: list[int]
    step: int
    members: int  # replicas in the quorum after it
    detected_at: float  # wall clock: the verdict
    waited_s: float  # from the step's sum issued to the verdict (the failure's detection)
    resumed_at: float | None = None  # the step's redone sum committed (lost)
    extra: dict = field(default_factory=dict)


def held_tensors(optimizer) -> list[torch.Tensor]:
    """What a replacement needs of this rank to continue as its peer at the same position:
    every fp32 state a checkpoint would load (plait/parallel/held.py) and the compute
    parameters a load fills directly, in the layout's fixed order (the update count
    travels beside them)."""
    optimizer.settle()  # ZeRO-1/2: the update's all-gathers into the parameters
    return ([h.tensor for h in optimizer.held_states()]
            + [p.data for _, p in optimizer.params_read_on_load()])


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return [groups[d] for d in sorted(groups, key=str)]


def _flat_by_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One flat buffer a dtype: a hand-over is a few large transfers, not one a tensor."""
    return [torch.cat([t.reshape(-1) for t in group]) for group in _by_dtype(tensors)]


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut into views shaped like `like`'s tensors, in order."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def _keys(store: dist.Store, keys: dict[str, str], timeout_s: float) -> dict[str, str]:
    """The values of `keys` (key -> the key that says its writer is gone) present within
    `timeout_s`, the missing ones left out; no waiting for a writer known to be gone."""
    deadline = time.monotonic() + timeout_s
    got: dict[str, str] = {}
    while True:
        for k in keys:
            if k not in got and store.check([k]):
                got[k] = store.get(k).decode()
        missing = [k for k in keys if k not in got]
        if not missing or time.monotonic() > deadline or store.check(
                [keys[k] for k in missing]):
            return got
        time.sleep(0.005)


class FaultTolerantReplicas:
    """This rank's side of the fault-tolerant replica dimension (module doc).

    `store`: the job's store, shared by every replica; `replica`, `generation`: this
    replica's slot and how many replacements it has had; `replicas`: dp_replicate;
    `mesh`: this replica's own mesh; `global_batch`: the whole job's rows a step (what the
    loss is normalised by, whoever trains them); `timeout_s`: how long a survivor waits
    for a replica that stopped answering; `min_replicas`: below it, a step's commit waits
    (at most `join_wait_s`) for replacements to join."""

    def __init__(self, store: dist.Store, replica: int, generation: int, replicas: int,
                 mesh: ParallelMesh, global_batch: int, timeout_s: float,
                 min_replicas: int = 1, join_wait_s: float = 600.0):
        self.store, self.replica, self.generation = store, replica, generation
        self.count, self.mesh, self.global_batch = replicas, mesh, global_batch
        self.timeout_s, self.min_replicas, self.join_wait_s = timeout_s, min_replicas, join_wait_s
        self.position = mesh.rank  # the same rank of every replica sums together
        self.leader = mesh.rank == 0
        self.epoch = Epoch(0, list(range(replicas)), SlotMap.initial(replicas),
                           dict.fromkeys(range(replicas), 0))
        self.joining = generation > 0
        self.events: list[Event] = []
        self.redone_steps = 0
        self._group: tuple[int, dist.ProcessGroup | None] | None = None
        self._admitted: set[str] = set()  # "r.g" of every replacement ever admitted
        self._started = False  # a sum committed: the start-up grace is over
        self._pending: list[list[int]] = []  # joiners the last commit admitted: [[r, g]]

    # ---- what the loop asks -----------------------------------------------------------
    def slots(self) -> list[int]:
        return self.epoch.slots.of(self.replica)

    def rows_of(self, slot: int) -> tuple[int, int]:
        """(index, count) of this rank's rows of the global batch for `slot`: the data-
        parallel slice (slot, dp coordinate) of dp_replicate x dp."""
        n = self.mesh.size("dp")
        return slot * n + self.mesh.coord("dp"), self.count * n

    def writes(self) -> bool:
        """Does this replica write checkpoints and metrics (the lowest member)?"""
        return self.replica == min(self.epoch.members)

    # ---- the step's sum ---------------------------------------------------------------
    def sum_gradients(self, step: int, grads: Callable[[], list[torch.Tensor]],
                      loss: torch.Tensor, train_slots: Callable[[list[int]], torch.Tensor]
                      ) -> torch.Tensor:
        """Sum `grads()` (this rank's reduced gradient shards, in place) and `loss` over the
        quorum; returns the summed loss. `train_slots(slots)` trains more slots on top of
        the gradients and returns their partial loss: a redo hands a lost member's slots
        to this replica. Raises ReplicaExcluded when the verdict leaves this replica out."""
        issued = time.time()
        for attempt in range(self.count + 1):
            started = time.monotonic()
            summed = self._try_sum(grads(), loss)
            # a sum that timed out already waited for a silent member: the posts get
            # what is left of the timeout (at least a moment), not a second one
            left = max(self._timeout() - (time.monotonic() - started), 0.5)
            verdict = self._verdict(step, attempt, summed is not None, left)
            if verdict["commit"]:
                self._end_startup_grace()
                for t, total in zip([*grads(), loss], summed, strict=True):
                    t.copy_(total)
                if attempt and self.events:
                    self.events[-1].resumed_at = time.time()
                self._admit(verdict.get("join", []))
                return loss
            self.redone_steps += attempt == 0
            lost = [r for r in self.epoch.members if r not in verdict["members"]]
            if self.replica in lost:
                raise ReplicaExcluded(f"replica {self.replica} left out of the quorum at "
                                      f"step {step} (it answered after {self.timeout_s:g} s)")
            before = set(self.slots())
            gens = dict(self.epoch.generations)
            self._move_to(Epoch(verdict["epoch"], verdict["members"],
                                self.epoch.slots.without(lost, verdict["members"]),
                                {r: g for r, g in gens.items() if r not in lost}))
            if lost:  # else every member answered but a sum failed: the same members again
                self._record(Event("lost", lost, step, len(self.epoch.members), time.time(),
                                   time.time() - issued,
                                   extra={"generations": {str(r): gens[r] for r in lost}}))
            extra = sorted(set(self.slots()) - before)
            if extra:  # the gradients held are still this replica's own: train on top
                loss += train_slots(extra)
        raise RuntimeError(f"step {step}: no quorum after {self.count + 1} tries")

    def _try_sum(self, grads: list[torch.Tensor], loss: torch.Tensor
                 ) -> list[torch.Tensor] | None:
        """This replica's sum over the quorum, into copies (a failed sum may still write
        its buffers later, so the gradients held are never its target): one flat buffer a
        dtype, then split; None unless every rank of this replica summed."""
        failed = torch.zeros(1, device=self.mesh.device.torch)
        out = None
        try:
            group = self._quorum_group()
            parts = _by_dtype(grads)
            flats = _flat_by_dtype(grads) + [loss.clone()]
            if group is not None:
                handles = [comm.all_reduce_on(f, group, DIM, self.mesh, self._link(),
                                              async_op=True,
                                              tag="metrics" if i == len(parts) else "grads")
                           for i, f in enumerate(flats)]
                for h in handles:
                    h.wait()
            summed = {id(t): v for group_, flat in zip(parts, flats, strict=False)
                      for t, v in zip(group_, _split(flat, group_), strict=True)}
            out = [summed[id(t)] for t in grads] + [flats[-1]]
        except RuntimeError:  # a member died or timed out: the verdict decides
            self._group = None
            failed.fill_(1)
        comm.all_reduce(failed, self.mesh, "world", op="max", tag="ft.metrics")
        return None if failed.item() else out

    def _quorum_group(self) -> dist.ProcessGroup | None:
        """The process group of the quorum's ranks at this position, made once per epoch
        on the job's store (every member makes it; a member that never comes fails it
        within `timeout_s`)."""
        e = self.epoch
        if self._group is not None and self._group[0] == e.number:
            return self._group[1]
        group = None
        if len(e.members) > 1:
            prefix = dist.PrefixStore(f"pg/{e.number}/{self.position}", self.store)
            rank, size = e.members.index(self.replica), len(e.members)
            timeout = timedelta(seconds=self._timeout())
            if self.mesh.device.is_cuda:  # the gradients' own device (not run on a GPU yet)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group = dist.ProcessGroupNCCL(prefix, rank, size, options)
            else:
                group = dist.ProcessGroupGloo(prefix, rank, size, timeout)
        self._group = (e.number, group)
        return group

    def _end_startup_grace(self) -> None:
        """A sum committed: from now on a silent member is waited for `timeout_s`, in the
        quorum group made during the start-up grace too (it is kept for its epoch)."""
        if self._started:
            return
        self._started = True
        group = self._group[1] if self._group is not None else None
        if group is not None:
            group._set_default_timeout(timedelta(seconds=self.timeout_s))

    def _timeout(self) -> float:
        return self.timeout_s if self._started else max(self.timeout_s, STARTUP_S)

    def _link(self) -> str:
        """"inter" when the quorum's ranks at this position sit on more than one node."""
        per = self.mesh.world_size
        nodes = {(m * per + self.position) // self.mesh.gpus_per_node
                 for m in self.epoch.members}
        return "inter" if len(nodes) > 1 else "intra"

    def _verdict(self, step: int, attempt: int, ok: bool, wait_s: float) -> dict:
        """Post this replica's outcome, read every member's, agree on the first verdict."""
        base = f"step/{step}/{attempt}"
        if self.leader:
            self.store.set(f"{base}/ok/{self.replica}", "1" if ok else "0")
        # the launcher marks a replica whose launch ended: no wait for its post
        keys = {f"{base}/ok/{r}": f"gone/{r}.{self.epoch.generations[r]}"
                for r in self.epoch.members}
        got = _keys(self.store, keys, wait_s)
        alive = [r for r, k in zip(self.epoch.members, keys, strict=True) if k in got]
        commit = len(alive) == len(keys) and all(v == "1" for v in got.values())
        mine = {"commit": commit, "members": alive, "epoch": self.epoch.number + 1}
        if commit:
            mine["join"] = self._ready_joiners()
            waited = time.monotonic()
            while len(alive) + len(mine["join"]) < self.min_replicas:  # wait for joiners
                if time.monotonic() - waited > self.join_wait_s:
                    raise RuntimeError(f"step {step}: {len(alive)} replicas, fewer than "
                                       f"parallel.min_replicas={self.min_replicas}, and no "
                                       f"replacement joined within {self.join_wait_s:g} s")
                time.sleep(0.05)
                mine["join"] = self._ready_joiners()
            mine["epoch"] = self.epoch.number + (1 if mine["join"] else 0)
        if not alive:  # nobody answered, not even this replica's leader: it is cut off
            mine["members"] = []
        stored = self.store.compare_set(f"{base}/verdict", "", json.dumps(mine))
        return json.loads(stored.decode())

    # ---- membership ---------------------------------------------------------------------
    def _move_to(self, epoch: Epoch) -> None:
        self.epoch, self._group = epoch, None

    def _ready_joiners(self) -> list[list[int]]:
        """Replacements that have asked to join and were not admitted yet: [[r, g]]."""
        count = self.store.add("join/count", 0)
        out = []
        for k in range(count):
            r, g = (int(x) for x in self.store.get(f"join/{k}").decode().split("."))
            if f"{r}.{g}" not in self._admitted and r not in self.epoch.members:
                out.append([r, g])
        return out

    def _admit(self, joiners: list[list[int]]) -> None:
        """A commit admitted `joiners`: from the next step they are members; the lowest
        member hands them the state once this step's update is done (`hand_over`)."""
        self._pending = joiners
        for r, g in joiners:
            self._admitted.add(f"{r}.{g}")

    def hand_over(self, step: int, state: Callable[[], list[torch.Tensor]]) -> None:
        """After step `step`'s update: admit the joiners its verdict named. The donor (the
        lowest member) sends `state()` (this rank's held tensors) to each joiner's rank
        at this position; the membership grows from the next step."""
        joiners, self._pending = self._pending, []
        if not joiners:
            return
        slots = self.epoch.slots
        for r, _ in joiners:
            slots = slots.joined(r)
        donor = min(self.epoch.members)
        new = Epoch(self.epoch.number + 1, sorted(self.epoch.members + [r for r, _ in joiners]),
                    slots, {**self.epoch.generations, **dict(joiners)})
        record = {**new.to_json(), "step": step + 1, "donor": donor,
                  "admitted": sorted(self._admitted)}
        if self.replica == donor and self.leader:
            for r, g in joiners:
                self.store.set(f"admit/{r}.{g}", json.dumps(record))
        started = time.time()
        self._move_to(new)
        if self.replica == donor:
            group = self._quorum_group()
            flats = _flat_by_dtype(state())  # once, whatever the joiners
            with self.mesh.ledger.outside_step():
                for r, _ in joiners:
                    for flat in flats:
                        comm.send_on(flat, new.members.index(r), group, DIM, self.mesh,
                                     self._link(), tag="ft.state")
        self._record(Event("joined", [r for r, _ in joiners], step + 1, len(new.members),
                           started, 0.0, extra={"donor": donor,
                                                "sent_s": time.time() - started}))

    def join(self, state: Callable[[], list[torch.Tensor]]) -> int:
        """A replacement: ask to join, wait to be admitted (at most `join_wait_s`), receive
        `state()`'s tensors in place from the donor at this position. Returns the step
        to start at."""
        if self.leader:
            k = self.store.add("join/next", 1) - 1
            self.store.set(f"join/{k}", f"{self.replica}.{self.generation}")
            self.store.add("join/count", 1)
        key = f"admit/{self.replica}.{self.generation}"
        self.store.wait([key], timedelta(seconds=self.join_wait_s))
        record = json.loads(self.store.get(key).decode())
        self._move_to(Epoch.from_json(record))
        self._admitted = set(record["admitted"])
        started = time.time()
        group = self._quorum_group()
        donor = self.epoch.members.index(record["donor"])
        tensors = state()
        with self.mesh.ledger.outside_step():
            for flat, parts in zip(_flat_by_dtype(tensors), _by_dtype(tensors), strict=True):
                comm.recv_on(flat, donor, group, DIM, self.mesh, self._link(), tag="ft.state")
                for t, got in zip(parts, _split(flat, parts), strict=True):
                    t.copy_(got)  # each state tensor filled in place
        self.joining, self._started = False, True
        self.events.append(Event("joined", [self.replica], record["step"],
                                 len(self.epoch.members), started, 0.0,
                                 extra={"donor": record["donor"],
                                        "received_s": time.time() - started}))
        return record["step"]

    def _record(self, event: Event) -> None:
        """Keep `event`; the lowest member's leader posts it for the launcher, which says
        it and kills a replica left out while still running (a stalled one)."""
        self.events.append(event)
        if self.leader and self.replica == min(self.epoch.members):
            k = self.store.add("event/next", 1) - 1
            self.store.set(f"event/{k}", json.dumps(event.__dict__))

    def summary(self, held: list[torch.Tensor] | None = None) -> dict:
        """The run's membership record; `held`: this rank's state, summarised as a digest
        that every replica's rank at this position must share (a replacement too)."""
        digest = None if held is None else float(sum(
            t.double().pow(2).sum() + t.double().sum() for t in held))
        return {"state_digest": digest, "replicas": self.count,
                "members": len(self.epoch.members), "epoch": self.epoch.number,
                "redone_steps": self.redone_steps, "events": [e.__dict__ for e in self.events]}
