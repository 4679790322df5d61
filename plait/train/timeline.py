"""One step's timeline on every rank, for any layout: compute spans beside the ledger's
communication spans (what `plait train --trace/--timeline` draws; plait/observe/timeline.py).

Recorded only when asked (`TrainOptions(timeline=True)`): `StepMarks` puts light markers on
this rank's model and step, and `gather_timeline` collects the last step on every rank.

* **Units**: each top-level child of a stage module that holds parameters, and each
  block of a ModuleList / ModuleDict (the embedding, `layers.i`, the final norm, the head:
  ZeRO's units, plait/parallel/zero_units.py). A unit's forward runs from its forward
  pre-hook to its forward hook; its backward from the moment the gradient of its output
  is computed (a hook on that tensor) to the gradient of its input (a hook on the input),
  or, for a unit whose input takes no gradient (the embedding's token ids), to the last
  gradient accumulated into its parameters. A forward run inside a backward action of
  the pipeline runtime (recomputation with the I/W split) is a recompute, `R`; a
  checkpointed block's recomputation inside autograd's backward (`train.recompute`) has
  no end marker (torch stops it early, before the forward hook), so the backward span
  that holds it is `BR`.
* **Actions**: the pipeline runtime's computes (`F`, `B`, `I`, `W` per stage and
  micro-batch: gradient accumulation without pipelining is the one-stage case) and the
  forwards it ran again inside an `I`.
* **Phases**: the step's parts on the loop's side, each ending at a `point(name)`: the
  runtime's micro-batches (whose actions are above), gradient sync, grad norm, optimizer,
  metrics.
* **Communication**: the step's ledger records (op, dim, tag, payload, bytes sent, group
  size), each from issue to completion, with the seconds its rank was blocked by it: the
  last `blocked` seconds before completion (the time inside `wait()`, or all of a
  synchronous call); the rest was in flight behind other work.

Times are the device timer's (plait/device/timer.py: `perf_counter` on CPU, the clock the
ledger uses; CUDA events resolved onto it on a GPU), one clock for every process of a
machine; the gathered timeline is in seconds from the first rank's start of the step.
With markers off, the loop's `point()` calls are no-ops on `NO_MARKS` and no hook exists.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.mesh import ParallelMesh

_BACKWARD_ACTIONS = ("B", "I", "W")


def timeline_units(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of each unit of a stage module: a top-level child holding
    parameters, each block of a ModuleList or ModuleDict ("layers.3")."""
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            for key, block in child.named_children():
                yield f"{name}.{key}", block
        elif any(True for _ in child.parameters()):
            yield name, child


class Marks:
    """What the loop calls at each step: as here, markers off (one method call each)."""

    def begin_step(self) -> None:
        pass

    def point(self, name: str) -> None:
        pass

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Work inside that is not the step's (an evaluation's forwards): left out."""
        yield


NO_MARKS = Marks()


class StepMarks(Marks):
    """Markers on this rank's stages and step; the spans of the current step only."""

    def __init__(self, stages: dict[int, nn.Module], mesh: ParallelMesh):
        self.timer = mesh.device.timer()  # the device's clock, as the runtime's actions
        self._hooks: list[Any] = []
        # per unit, the currently open backward span (closed by its input's gradient)
        self._open_backward: dict[int, list] = {}
        self._forward_start: dict[int, Any] = {}
        for stage, module in stages.items():
            for name, unit in timeline_units(module):
                key = (name, stage, id(unit))
                self._hooks += [
                    unit.register_forward_pre_hook(partial(self._pre_forward, key)),
                    unit.register_forward_hook(partial(self._post_forward, key))]
                self._hooks += [p.register_post_accumulate_grad_hook(
                    partial(self._param_grad, key)) for p in unit.parameters(recurse=True)
                    if p.requires_grad]
        self.begin_step()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin_step(self) -> None:
        """Forget the previous step's spans: only the last step is kept."""
        self.units: list[list] = []  # [kind, name, stage, start mark, end mark]
        self.points: list[tuple[str, Any]] = []
        self._open_backward.clear()
        self.points.append(("start", self.timer.mark()))

    def point(self, name: str) -> None:
        """The phase `name` (of the loop, after the runtime's step) ends here."""
        self.points.append((name, self.timer.mark()))

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        kept = len(self.units)
        try:
            yield
        finally:
            del self.units[kept:]

    # ---- hooks -------------------------------------------------------------------------
    def _pre_forward(self, key: tuple, module: nn.Module, args: tuple) -> None:
        uid = key[2]
        if torch._C._current_graph_task_id() != -1:
            # a checkpointed block computed again for its backward: torch stops the
            # recomputation as soon as it has what backward needs, before the forward
            # hook, so it has no end of its own; the backward span holding it says so
            if uid in self._open_backward:
                self._open_backward[uid][0] = "BR"
            return
        self._forward_start[uid] = self.timer.mark()

    def _post_forward(self, key: tuple, module: nn.Module, args: tuple, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation that ran to its end: inside its backward span
        name, stage, uid = key
        self.units.append(["F", name, stage, self._forward_start.pop(uid), self.timer.mark()])
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return  # no graph (a pipeline F that its I runs again): no backward to mark
        output.register_hook(partial(self._backward_start, key))
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and x.requires_grad:
            x.register_hook(partial(self._backward_end, uid))

    def _backward_start(self, key: tuple, grad: torch.Tensor) -> None:
        name, stage, uid = key
        span = ["B", name, stage, self.timer.mark(), None]
        self.units.append(span)
        self._open_backward[uid] = span

    def _backward_end(self, uid: int, grad: torch.Tensor) -> None:
        span = self._open_backward.pop(uid, None)
        if span is not None:
            span[4] = self.timer.mark()

    def _param_grad(self, key: tuple, param: nn.Parameter) -> None:
        """A unit without an input gradient ends its backward with its last parameter's."""
        span = self._open_backward.get(key[2])
        if span is not None:
            span[4] = self.timer.mark()

    # ---- this rank's step, on one clock -------------------------------------------------
    def rank_record(self, runtime: Any, mesh: ParallelMesh, step: int) -> dict:
        """This rank's last step: units, actions, phases and communication, in seconds."""
        sec = self.timer.seconds
        actions = [list(e) for e in runtime.steps_events[-1]] if runtime.steps_events else []
        units = _unit_spans([[k, n, s, sec(a), None if b is None else sec(b)]
                             for k, n, s, a, b in self.units], actions)
        marks = [(n, sec(m)) for n, m in self.points]
        phases = [[n, a, b] for (_, a), (n, b) in zip(marks, marks[1:], strict=False)]
        recompute = ([[s, mb, a, b] for s, mb, a, b in runtime.steps_recompute[-1]]
                     if runtime.steps_recompute else [])
        return {
            "rank": mesh.rank,
            "coords": {d: c for d, c in mesh.coords.items() if mesh.size(d) > 1},
            "window": [marks[0][1], marks[-1][1]],
            "actions": actions, "recompute": recompute, "units": units,
            "phases": phases,
            "comm": [{"op": r.op, "dim": r.dim, "tag": r.tag, "payload": r.payload,
                      "sent": r.sent, "received": r.received, "group_size": r.group_size,
                      "start": r.start, "end": r.end, "blocked": r.blocked}
                     for r in mesh.ledger.for_step(step)],
        }


def _unit_spans(units: list[list], actions: list[list]) -> list[list]:
    """Each unit span within the runtime action it started in: a forward inside a backward
    action is a recompute (the I/W split runs the stage again inside I), and a backward
    still open at the action's end (an embedding whose parameters' gradients a later W
    accumulates) ends with the action."""
    out = []
    for kind, name, stage, start, end in units:
        end = start if end is None else end
        inside = next((a for a in actions if a[3] <= start < a[4]), None)
        if inside is not None:
            kind = "R" if kind == "F" and inside[0] in _BACKWARD_ACTIONS else kind
            end = min(end, inside[4])
        out.append([kind, name, stage, start, end])
    return out


def gather_timeline(marks: StepMarks, runtime: Any, mesh: ParallelMesh, step: int,
                    layout: str) -> dict:
    """Every rank's record of `step`, gathered over the world (ledgered outside the step,
    tag "timeline"); times in seconds from the earliest rank's start of the step. Every
    rank returns the same dict: {"step", "layout", "ranks": [record per rank]}."""
    ranks = all_gather_json(marks.rank_record(runtime, mesh, step), mesh)
    origin = min(r["window"][0] for r in ranks)
    for r in ranks:
        _shift(r, origin)
    return {"step": step, "layout": layout, "ranks": ranks}


def _shift(rec: dict, origin: float) -> None:
    rec["window"] = [t - origin for t in rec["window"]]
    for row in rec["actions"]:
        row[3], row[4] = row[3] - origin, row[4] - origin
    for row in rec["recompute"]:
        row[2], row[3] = row[2] - origin, row[3] - origin
    for row in rec["units"]:
        row[3], row[4] = row[3] - origin, row[4] - origin
    for row in rec["phases"]:
        row[1], row[2] = row[1] - origin, row[2] - origin
    for c in rec["comm"]:
        c["start"], c["end"] = c["start"] - origin, c["end"] - origin


def all_gather_json(obj: Any, mesh: ParallelMesh) -> list[Any]:
    """`obj` of every rank, in rank order: its JSON as bytes, through the ledger."""
    data = json.dumps(obj).encode()
    dev, n = mesh.device.torch, mesh.world_size
    with mesh.ledger.outside_step():  # not part of any training step
        sizes = torch.zeros(n, dtype=torch.int64, device=dev)
        comm.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=dev),
                        mesh, "world", tag="timeline")
        width = int(sizes.max())
        mine = torch.zeros(width, dtype=torch.uint8, device="cpu")  # filled from bytes here
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = torch.empty(n * width, dtype=torch.uint8, device=dev)
        comm.all_gather(every, mine.to(dev), mesh, "world", tag="timeline")
    every, sizes = every.cpu(), sizes.tolist()
    return [json.loads(bytes(every[r * width:r * width + sizes[r]].numpy()))
            for r in range(n)]
