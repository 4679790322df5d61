"""Fault-tolerant replicas (`plait train --fault-tolerance`, plait/parallel/
fault_tolerance.py, plait/launch/replicas.py): a replica that dies (SIGKILL) or stops
answering (SIGSTOP) leaves the step's quorum, the survivors redo the step with its
micro-batches (no step lost, the global batch kept), a replacement joins from a live
replica over the network, and the run's losses, grad norms and final parameters stay
within parity of the single-process run.

The quorum protocol runs first in one process (threads as replicas, a HashStore as the
job's store); then three launched jobs, one a layout: ZeRO-2 inside each replica with a
killed rank, a pipeline inside each replica with a stalled one, and plain data-parallel
replicas (zero=0) with a killed rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import BASE, reference, token_file
from test_clean_stop import assert_all_gone

from plait.checkpoint.format import read_metadata
from plait.checkpoint.reader import full_tensor
from plait.config import ParallelConfig
from plait.mesh import ParallelMesh
from plait.parallel.fault_tolerance import Epoch, FaultTolerantReplicas, SlotMap
from plait.testing import assert_parity

pytestmark = pytest.mark.slow  # process trees: `make test-slow`

TIMEOUT_S = 2.0


def test_lost_slots_go_to_the_least_loaded_survivors_and_come_back():
    slots = SlotMap.initial(4)
    after = slots.without([1, 3], [0, 2])
    assert after.of(0) == [0, 1] and after.of(2) == [2, 3]
    assert after.without([0], [2]).of(2) == [0, 1, 2, 3]
    assert after.joined(1).of(1) == [1] and after.joined(1).of(0) == [0]


def _replica(store: dist.Store, r: int, count: int, generation: int = 0,
             min_replicas: int = 1) -> FaultTolerantReplicas:
    mesh = ParallelMesh.arithmetic(ParallelConfig(), 0)
    return FaultTolerantReplicas(store, r, generation, count, mesh, global_batch=count,
                                 timeout_s=TIMEOUT_S, min_replicas=min_replicas,
                                 join_wait_s=30.0)


def _in_threads(*calls) -> list:
    out, errors = [None] * len(calls), []

    def run(i, call):
        try:
            out[i] = call()
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_a_silent_replica_is_left_out_and_its_slot_trained_by_a_survivor():
    """Replica 2 never answers: after the timeout replicas 0 and 1 redo the step without
    it, replica 0 (the less loaded, lower one) trains slot 2 on top of its own, and both
    end with the sum of all three slots' gradients and losses."""
    store = dist.HashStore()
    reps = [_replica(store, r, 3) for r in range(2)]  # replica 2 is silent
    for rep in reps:  # a later step: no start-up grace (module STARTUP_S)
        rep._started = True

    def step(rep):
        grads = [torch.full((5,), float(rep.replica + 1))]
        loss = torch.tensor([10.0 * (rep.replica + 1)], dtype=torch.float64)

        def train_slots(slots):  # slot k's gradient is k + 1, its loss 10 (k + 1)
            grads[0] += sum(k + 1 for k in slots)
            return torch.tensor([sum(10.0 * (k + 1) for k in slots)], dtype=torch.float64)

        total = rep.sum_gradients(0, lambda: grads, loss, train_slots)
        return grads[0].tolist(), float(total), rep.slots()

    (g0, l0, s0), (g1, l1, s1) = _in_threads(*(lambda r=r: step(r) for r in reps))
    assert g0 == g1 == [6.0] * 5 and l0 == l1 == 60.0
    assert (s0, s1) == ([0, 2], [1])
    for rep in reps:
        (event,) = rep.events
        assert (event.kind, event.replicas, event.members) == ("lost", [2], 2)
        assert rep.epoch.members == [0, 1] and rep.redone_steps == 1
    assert json.loads(store.get("event/0"))["replicas"] == [2]  # for the launcher


def test_a_replacement_joins_with_the_donors_state_at_the_next_step():
    """Replica 1 was lost; its replacement (generation 1) asks to join. With
    min_replicas=2 the survivor's next commit waits for it, admits it, and after the
    step's update sends it every state tensor; the replacement starts at the next step
    with the same epoch, members and its own slot back."""
    store = dist.HashStore()
    donor = _replica(store, 0, 2, min_replicas=2)
    donor.epoch = Epoch(3, [0], SlotMap({0: 0, 1: 0}), {0: 0})
    joiner = _replica(store, 1, 2, generation=1)
    state = [torch.arange(6.0).reshape(2, 3), torch.tensor([7], dtype=torch.float64)]
    received = [torch.zeros(2, 3), torch.zeros(1, dtype=torch.float64)]

    def lead():
        grads = [torch.ones(3)]
        loss = torch.ones(1, dtype=torch.float64)
        donor.sum_gradients(5, lambda: grads, loss, lambda slots: loss * 0)
        donor.hand_over(5, lambda: state)

    start, _ = _in_threads(lambda: joiner.join(lambda: received), lead)
    assert start == 6
    assert all(torch.equal(a, b) for a, b in zip(received, state, strict=True))
    for rep in (donor, joiner):
        assert rep.epoch.number == 4 and rep.epoch.members == [0, 1]
        assert rep.epoch.generations == {0: 0, 1: 1}
    assert (donor.slots(), joiner.slots()) == ([0], [1])
    assert donor.events[-1].kind == "joined" and donor.events[-1].replicas == [1]


STEPS = 6


def _launch(tmp_path: Path, layout: list[str], fault: str, *flags: str):
    marker = f"plait-ft-{uuid.uuid4().hex[:12]}"
    metrics, ck = tmp_path / f"{marker}.jsonl", tmp_path / "ck"
    sets = [a for s in [*BASE, f"train.steps={STEPS}", "model.tie_embeddings=false"]
            for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--data",
                        str(token_file()), *sets, *layout, "--fault-tolerance",
                        "--min-replicas", "2", "--quiet", "--metrics-out", str(metrics),
                        "--checkpoint-dir", str(ck), "--checkpoint-every", str(STEPS),
                        *flags],
                       env={**os.environ, "PLAIT_TEST_FAULT": fault},
                       capture_output=True, text=True, timeout=300)
    assert_all_gone(marker)  # the lost replica's ranks and agent too
    return r, metrics, ck


@pytest.mark.parametrize(("layout", "fault", "timeout", "precision"), [
    # ZeRO-2 over 2 ranks inside each replica; rank 3 (replica 1's second) killed
    (["--dp-shard", "2", "--dp-replicate", "2", "--zero", "2"], "kill:3:1", "30", "fp64"),
    # a 1F1B pipeline inside each replica, ZeRO-1; rank 2 (replica 1's first stage) stalls
    (["--dp-replicate", "2", "--pp", "2", "--zero", "1"], "stop:2:2", "6", "fp64"),
    # plain data-parallel copies (zero=0, torchft's FT-DDP); rank 2 (replica 1's first) killed
    (["--dp-shard", "2", "--dp-replicate", "2", "--zero", "0"], "kill:2:2", "30", "fp64"),
], ids=["zero2-killed", "pp2-stalled", "plain-killed"])
def test_a_lost_replica_costs_no_step_and_keeps_parity(tmp_path, layout, fault, timeout,
                                                       precision):
    r, metrics, ck = _launch(tmp_path, layout, fault, "--replica-timeout", timeout)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    kind, _, step = fault.split(":")
    lost_at = int(step) + 1  # the fault fires after that step's row: the next step redoes
    assert f"plait: step {lost_at}: replica 1 left the quorum" in r.stderr, r.stderr
    assert "replica 1 joined from replica 0; 2 of 2 train" in r.stderr, r.stderr
    if kind == "stop":  # a stalled replica is killed by the launcher once left out
        assert "replica 1 left out for not answering" in r.stderr, r.stderr
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    body, summary = rows[:-1], rows[-1]
    assert [x["step"] for x in body] == list(range(STEPS))  # each step once: none lost
    assert [x["replicas"] for x in body][lost_at] == 1  # the step redone by one
    ft = summary["fault_tolerance"]
    assert ft["steps_lost"] == 0 and ft["redone_steps"] >= 1
    assert [e["kind"] for e in ft["events"]] == ["lost", "joined"], ft["events"]
    assert len(set(ft["state_digests"].values())) == 1, ft["state_digests"]  # joiner alike
    assert summary["layout"].startswith("dp_replicate=2 fault-tolerant x ")
    path = ck / f"step-{STEPS:08d}"  # written by the lowest live replica
    meta = read_metadata(path)
    params = {n: torch.from_numpy(full_tensor(path, meta, n)) for n in meta["tensors"]}
    assert_parity({"losses": [x["loss"] for x in body],
                   "grad_norms": [x["grad_norm"] for x in body], "params": params},
                  reference(f"train.steps={STEPS}", "model.tie_embeddings=false"), precision)
