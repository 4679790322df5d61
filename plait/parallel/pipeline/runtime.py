"""The pipeline runtime: execute one rank's lowered action list with real tensors.

The contract is the one `lower.py` states and `check.py` simulates:
  * a run of consecutive transfers is posted as one `batch_isend_irecv` (ledgered, dim
    "pp"); posting never blocks, so receives sit posted ahead of their consumer;
  * a compute waits only for the receives carrying its own inputs;
  * sends are reaped as they complete and all waited for at the end of the step.
Gradient accumulation without pipelining is the one-stage case: a schedule of F, B pairs
on one rank and no transfers.

The I/W split is generic, through autograd (plait/parallel/pipeline/split.py): F keeps
each parameter-owning module's output, I takes the gradients of the stage input and of
those outputs, W each module's weight gradient from its output's; between I and W only
the saved tensors W reads are held. A chain's first stage has no input gradient to send:
where its W directly follows its I (zb-h1's and zb-h2's rank 0), I only keeps the output
gradient and W runs the whole backward, one autograd pass instead of the split's two
(which cost about 10 % more), in the same place; not with recomputation. Elsewhere the
split stays: moving I's work into a later W leaves gaps in an order built for both.

Recomputation with the split (plait/model/recompute.py, docs/recompute.md): torch's
checkpoint recomputes once per backward call, and I and W are two calls that read the
same saved tensors (a matmul's node keeps both operands), so per-block checkpointing would
run each forward twice. A (stage, micro-batch) whose backward is split therefore runs its
F without a graph, under the selective policy's forward context (which keeps the saved
groups' outputs; nothing under full), and its I first runs the stage forward again under
the policy's recompute context: the saved outputs are returned, the rest computed, one
graph built, which I and W then share exactly as without recomputation. One extra forward
(less the saved groups) per micro-batch, as with whole-B schedules; timed per step in
`steps_recompute`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import nn

from plait import comm
from plait.comm.ops import Handle
from plait.mesh import ParallelMesh
from plait.model.packed import document_ids, masked_targets
from plait.parallel.pipeline.fb_overlap import FBPair
from plait.parallel.pipeline.split import (
    Deferred,
    OutputCapture,
    SavedStore,
    backward_input,
    backward_weight,
)
from plait.schedule.ir import Action, Schedule, fb_pairs, split_backwards
from plait.schedule.lower import lower, speculative_prefix

__all__ = ["OutputCapture", "PipelineRuntime", "backward_input", "backward_weight"]

Event = tuple[str, int, int, float, float]  # (kind, stage, microbatch, start, end)
# per compute, beside its Event: (when it began waiting for its input, thread CPU seconds).
# wait start == Event start when the input was local or already there; CPU < wall when
# the OS ran another process on this rank's core during the compute (time-slicing).
Detail = tuple[float, float]


# ---- the runtime ----------------------------------------------------------------------

@dataclass
class _Live:
    """What one (stage, micro-batch) holds between its F and its last backward action."""
    x: torch.Tensor | None  # stage input (a leaf) or None on a chain's first stage
    out: torch.Tensor | None
    kept: list = field(default_factory=list)
    deferred: Deferred = field(default_factory=list)
    # recomputation with the I/W split: the policy's recompute context; I runs F again
    redo: AbstractContextManager | None = None
    store: SavedStore | None = None  # a split backward's saved tensors (split.py)
    grad: torch.Tensor | None = None  # a first stage's output gradient, from I to its W


class PipelineRuntime:
    """Runs `schedule` for this rank's `stages` ({stage id: module}), one step at a time."""

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module], mesh: ParallelMesh,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype,
                 before_weight_grad: Callable[[bool], None] | None = None,
                 after_weight_grad: Callable[[bool], None] | None = None, dim: str = "pp",
                 positions: torch.Tensor | None = None):
        """`before_weight_grad(last)` runs before each B/W (last: the stage's final one, after
        which data parallel may reduce its gradients), `after_weight_grad(last)` after each
        (last: this rank's final one of the step). The optimizer protocol plugs in here.
        `positions` (context parallel): this rank's token positions in each sequence; the
        first stage takes those columns of the inputs, the last those of the targets, and
        every stage hands them to RoPE and the attention mask."""
        self.schedule = schedule if schedule.lowered else lower(schedule)
        self.mesh, self.dim = mesh, dim
        # compute actions are timed on the device's clock (CUDA events on a GPU: a host
        # clock would time kernel launches); waits and posts are host-side, on perf_counter
        self.timer = mesh.device.timer()
        self.me = mesh.coord(dim) if mesh.size(dim) > 1 else 0
        self.peers = mesh.group_ranks[dim] if mesh.size(dim) > 1 else [mesh.rank]
        self.actions = self.schedule.actions[self.me]
        self.stages, self.positions = stages, positions
        # packed documents (plait/model/packed.py): the end-of-document token, or None
        self.documents: int | None = None
        # packed documents split by document (plait/parallel/context.py,
        # `documents_positions`): document ids -> this rank's positions, or None for the
        # one split of `positions`
        self.document_split: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.act_shape, self.act_dtype = act_shape, act_dtype
        self.before_weight_grad, self.after_weight_grad = before_weight_grad, after_weight_grad
        # a first stage's I sends nothing: where its W follows at once, that I keeps the
        # output gradient and the W runs the whole backward (see the module docstring);
        # the other (stage, micro-batch) pairs with an I are split: with recomputation, I
        # runs their forward again (once, for I and W)
        recompute = any(m.recompute is not None for m in stages.values())
        self.whole_at_w, self.split = split_backwards(self.schedule, self.me, recompute)
        # capture hooks only where the schedule splits I from W
        self.capture = {s: OutputCapture(m) for s, m in stages.items()
                        if any(k == s for k, _ in self.split)}
        # the last gradient-writing action of each stage: data parallel syncs after it
        last: dict[int, int] = {}
        for i, a in enumerate(self.actions):
            if a.kind in ("B", "W"):
                last[a.stage] = i
        self.last_grad_action = set(last.values())
        # a forward-only schedule (an evaluation, `lower.forward_only`) keeps nothing for a
        # backward: each stage's activations are dropped once its output has gone on
        self.keeps_graph = bool(last)
        self.final_grad_action = max(last.values(), default=-1)
        # F&B pairs (a schedule lowered with pair_fb): run interleaved, see fb_overlap.py
        self.pairs = set(fb_pairs(self.schedule)[self.me])
        self.fb_pair = FBPair(stages.values(), mesh.device.torch) if self.pairs else None
        # post-validation: where the previous step's update is checked (see `step`)
        self.cut = speculative_prefix(self.schedule)[self.me]
        self.steps_restarts: list[int] = []  # per step: runs of the step's prefix dropped
        self.steps_events: list[list[Event]] = []  # per step: this rank's computes
        self.steps_window: list[tuple[float, float]] = []  # per step: (start, end) on this rank
        # per step: the post-validation check at the cut, [(start, end)] (perf_counter
        # seconds, as the posts), or [] where the step had none (the first, the barrier,
        # or its predecessor checked before it began)
        self.steps_check: list[list[tuple[float, float]]] = []
        self.steps_detail: list[list[Detail]] = []  # per step, per compute: see `Detail`
        # per step: each post of a batch of transfers, (start, end, thread CPU seconds)
        self.steps_posts: list[list[tuple[float, float, float]]] = []
        # per step: each forward run again inside an I, (stage, mb, start, end) seconds
        self.steps_recompute: list[list[tuple[int, int, float, float]]] = []

    # ---- one step ---------------------------------------------------------------------
    def step(self, micro: Sequence[torch.Tensor], tokens_in_global_batch: int,
             validate: Callable[[], bool] | None = None) -> torch.Tensor:
        """Run every action; `micro[mb]` is (rows, seq+1) tokens. Returns the summed loss of
        the chains that end on this rank (float64, shape (1,); zero elsewhere).

        `validate` (post-validation, plait/parallel/post_validation.py): called once, at
        the end of this rank's speculative prefix (`lower.speculative_prefix`: forwards
        only, closed under matching transfers); True means the weights the prefix ran on
        were wrong: the prefix's transfers are completed, its work dropped, and the step
        runs again from its first action (every rank alike: the verdict is global)."""
        if len(micro) != self.schedule.microbatches:
            raise ValueError(f"{len(micro)} micro-batches for a schedule of "
                             f"{self.schedule.microbatches}")
        self._micro, self._ntok = micro, tokens_in_global_batch
        self._posts: list[tuple[float, float, float]] = []
        self._recomputes: list[tuple[int, int, object, object]] = []
        self._check: list[tuple[float, float]] = []
        start = self.timer.mark()
        restarts = 0
        while (ran := self._run(validate))[0] is None:  # the check failed: run it again
            restarts, validate = restarts + 1, None
        events, detail = ran
        for h, _ in self._sends + list(self._sends_f.values()):
            h.wait()
        self._sends_f.clear()
        if self._live or self._recvs or self._to_send:
            raise RuntimeError(f"rank {self.me}: step ended with work left: live "
                               f"{sorted(self._live)}, receives {sorted(self._recvs)}")
        self._sends.clear()
        self.steps_restarts.append(restarts)
        self._record_step(start, events, detail)
        return self._loss

    def _run(self, validate: Callable[[], bool] | None
             ) -> tuple[list[Event] | None, list[Detail]]:
        """One pass over the action list: its events and details, or (None, []) when
        `validate` (at the cut) asked for the step to run again."""
        self._live: dict[tuple[int, int], _Live] = {}
        self._recvs: dict[tuple[str, int, int], tuple[torch.Tensor, Handle]] = {}
        self._local_in: dict[tuple[int, int], torch.Tensor] = {}  # same-rank stage boundary
        self._local_grad: dict[tuple[int, int], torch.Tensor] = {}
        self._to_send: dict[tuple[str, int, int], torch.Tensor] = {}
        self._sends: list[tuple[Handle, torch.Tensor]] = []
        # forward sends by (stage, mb): complete once the gradient for that output arrives
        self._sends_f: dict[tuple[int, int], tuple[Handle, torch.Tensor]] = {}
        self._loss = torch.zeros(1, dtype=torch.float64, device=self.mesh.device.torch)
        events: list[Event] = []
        detail: list[Detail] = []
        cut = self.cut if validate is not None else -1
        i = 0
        while i < len(self.actions):
            if i == cut:  # the check: its window is idle time the runtime_gap leaves out
                t0 = time.perf_counter()
                failed = validate()
                self._check.append((t0, time.perf_counter()))
                if failed:
                    self._drain()
                    return None, []
            if self.actions[i].is_comm:
                j = i + 1  # a batch of transfers ends at the cut
                while j < len(self.actions) and self.actions[j].is_comm and j != cut:
                    j += 1
                self._post(self.actions[i:j])
                i = j
                continue
            if i in self.pairs:
                for ev, d in self._run_pair(i):
                    events.append(ev)
                    detail.append(d)
                self._reap_sends()
                i += 2
                continue
            self._wait_start = None
            c0 = time.thread_time()
            ev = self._compute(self.actions[i], i)
            events.append(ev)
            detail.append((self._wait_start, time.thread_time() - c0))
            self._reap_sends()
            i += 1
        return events, detail

    def _run_pair(self, i: int) -> list[tuple[Event, Detail]]:
        """The F&B pair at actions i, i + 1: both inputs first (the pair starts with them
        there, as the simulator lays it out), then the two interleaved (fb_overlap.py);
        their events and details, F's first."""
        self._wait_start = None
        for a in self.actions[i:i + 2]:
            key = ("B" if a.kind in ("I", "B") else "F", a.stage, a.microbatch)
            if key in self._recvs:
                self._wait_start = self._wait_start or time.perf_counter()
                self._recvs[key][1].wait()  # idempotent: the compute's own wait returns
        waited = self._wait_start

        def side(index: int) -> Callable[[], tuple[Event, Detail]]:
            def run() -> tuple[Event, Detail]:
                c0 = time.thread_time()
                ev = self._compute(self.actions[index], index)
                return ev, (waited if index == i else None, time.thread_time() - c0)
            return run

        return list(self.fb_pair.run(side(i), side(i + 1)))

    def _drain(self) -> None:
        """Complete every transfer the speculative prefix posted (its peers posted the
        matching ones: the prefix is closed) and drop what it computed."""
        for _, h in self._recvs.values():
            h.wait()
        for h, _ in self._sends + list(self._sends_f.values()):
            h.wait()
        self._recvs.clear()
        self._sends_f.clear()
        self._sends.clear()

    def _record_step(self, start: object, events: list[Event], detail: list[Detail]) -> None:
        """The step's marks on one clock (seconds): each action's (start, end); a detail's
        input-ready time is its wait's start, or the action's start if it did not wait."""
        sec = self.timer.seconds
        end = sec(self.timer.mark())
        timed = [(k, s, mb, sec(a), sec(b)) for k, s, mb, a, b in events]
        self.steps_events.append(timed)
        self.steps_detail.append([(ev[3] if w is None else w, c)
                                  for ev, (w, c) in zip(timed, detail, strict=True)])
        self.steps_posts.append(self._posts)
        self.steps_recompute.append([(s, mb, sec(a), sec(b)) for s, mb, a, b in self._recomputes])
        self.steps_window.append((sec(start), end))
        self.steps_check.append(self._check)

    def _post(self, actions: Sequence[Action]) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        sends, recvs, keys, send_keys = [], [], [], []
        for a in actions:
            peer = self.peers[a.peer]
            if a.kind in ("SEND_F", "SEND_B"):
                sends.append((self._to_send.pop((a.kind[-1], a.stage, a.microbatch)), peer))
                send_keys.append((a.kind, a.stage, a.microbatch))
            else:
                buf = torch.empty(self.act_shape, dtype=self.act_dtype,
                                  device=self.mesh.device.torch)
                recvs.append((buf, peer))
                keys.append((a.kind[-1], a.stage, a.microbatch))
        handles = comm.batch_send_recv(sends, recvs, self.mesh, self.dim, tag="pp")
        for h, (t, _), (kind, st, mb) in zip(handles, sends, send_keys, strict=False):
            if kind == "SEND_F":
                self._sends_f[st, mb] = (h, t)
            else:
                self._sends.append((h, t))  # keep the tensor alive until the send completes
        for key, (buf, _), h in zip(keys, recvs, handles[len(sends):], strict=True):
            self._recvs[key] = (buf, h)
        self._posts.append((t0, time.perf_counter(), time.thread_time() - c0))

    def _reap_sends(self) -> None:
        # free sent activations as soon as the transfer is done, not at the step's end
        if self._sends and self._sends[0][0].is_completed():
            keep = []
            for h, t in self._sends:
                if h.is_completed():
                    h.wait()
                else:
                    keep.append((h, t))
            self._sends = keep

    def _arrived(self, kind: str, stage: int, mb: int) -> torch.Tensor:
        buf, h = self._recvs.pop((kind, stage, mb))
        self._wait_start = time.perf_counter()
        h.wait()
        if kind == "B" and (stage, mb) in self._sends_f:
            # the peer received this stage's output before computing the gradient that just
            # arrived, so the send is complete: waiting cannot block, and the output is freed
            # with its backward instead of at the step's end (gloo never reports a send
            # complete before wait())
            self._sends_f.pop((stage, mb))[0].wait()
        return buf

    def _targets(self, mb: int) -> torch.Tensor:
        """This rank's targets of micro-batch mb; with packed documents, an end-of-document
        token's target (across the boundary) ignored."""
        rows = self._micro[mb]
        if self.documents is None:
            return self._columns(rows[:, 1:], mb)
        return self._columns(masked_targets(rows[:, :-1], rows[:, 1:], self.documents), mb)

    def _docs(self, mb: int) -> torch.Tensor | None:
        """Packed documents: the document of every input token of micro-batch mb."""
        if self.documents is None:
            return None
        return document_ids(self._micro[mb][:, :-1], self.documents)

    def _positions(self, mb: int) -> torch.Tensor | None:
        """This rank's token positions in micro-batch mb: `positions`, or one row of them
        per sequence when each micro-batch is split by its documents."""
        if self.document_split is None:
            return self.positions
        return self.document_split(self._docs(mb))

    def _columns(self, tokens: torch.Tensor, mb: int) -> torch.Tensor:
        """This rank's tokens of each sequence (all of them without context parallel)."""
        pos = self._positions(mb)
        if pos is None:
            return tokens
        pos = pos.to(tokens.device)
        return tokens.gather(1, pos) if pos.dim() == 2 else tokens.index_select(1, pos)

    def _compute(self, a: Action, index: int) -> Event:
        sched, s, mb = self.schedule, a.stage, a.microbatch
        first, last = sched.prev_stage(s) is None, sched.next_stage(s) is None
        if a.kind == "F":
            if first:
                x = self._columns(self._micro[mb][:, :-1], mb)
            elif ("F", s, mb) in self._recvs:
                x = self._arrived("F", s, mb).requires_grad_()
            else:
                x = self._local_in.pop((s, mb))
            t0 = self.timer.mark()
            live = self._forward(s, mb, x, first, last)
            if self.keeps_graph:
                self._live[s, mb] = live
            out = live.out
            nxt = sched.next_stage(s)
            if last:
                self._loss += out.detach().double()
            elif sched.stage_to_rank[nxt] == self.me:
                self._local_in[nxt, mb] = out.detach().requires_grad_()
            else:
                self._to_send["F", s, mb] = out.detach()
            return ("F", s, mb, t0, self.timer.mark())

        if a.kind == "W":
            t0 = self.timer.mark()
            if self.before_weight_grad is not None:
                self.before_weight_grad(index in self.last_grad_action)
            live = self._live.pop((s, mb))
            if (s, mb) in self.whole_at_w:
                torch.autograd.backward(live.out, live.grad)
            else:
                backward_weight(live.deferred)
                live.store.release()
            if self.after_weight_grad is not None:
                self.after_weight_grad(index == self.final_grad_action)
            return ("W", s, mb, t0, self.timer.mark())

        # B or I: needs the gradient of the stage output
        if last:
            grad_out = None
        elif ("B", s, mb) in self._recvs:
            grad_out = self._arrived("B", s, mb)
        else:
            grad_out = self._local_grad.pop((s, mb))
        t0 = self.timer.mark()
        live = self._live[s, mb]
        if live.redo is not None:
            self._forward_again(s, mb, live, first, last)
        if a.kind == "B":
            if self.before_weight_grad is not None:
                self.before_weight_grad(index in self.last_grad_action)
            torch.autograd.backward(live.out, grad_out)
            grad_x = None if first else live.x.grad
            del self._live[s, mb]  # activations of this micro-batch are free now
            if self.after_weight_grad is not None:
                self.after_weight_grad(index == self.final_grad_action)
        elif (s, mb) in self.whole_at_w:
            live.grad, grad_x = grad_out, None
        else:
            inputs = [] if first else [live.x]
            grads, live.deferred = backward_input(live.out, grad_out, inputs, live.kept)
            grad_x = grads[0] if inputs else None
            live.x, live.out, live.kept = None, None, []  # W needs only (params, y, dy)
            live.store.keep_only_for_weights(live.deferred)  # and what their branches read
        prev = sched.prev_stage(s)
        if prev is not None:
            if sched.stage_to_rank[prev] == self.me:
                self._local_grad[prev, mb] = grad_x
            else:
                self._to_send["B", s, mb] = grad_x
        return (a.kind, s, mb, t0, self.timer.mark())

    def _forward(self, s: int, mb: int, x: torch.Tensor, first: bool, last: bool) -> _Live:
        """Stage s on micro-batch mb: with its graph (and its outputs captured for W where
        the backward is split), or, split with recomputation, without one (see the
        module docstring)."""
        stage, cap = self.stages[s], self.capture.get(s)
        targets = self._targets(mb) if last else None
        kw = {"positions": self._positions(mb), "docs": self._docs(mb)}
        if stage.recompute is not None and (s, mb) in self.split:
            keep, redo = stage.recompute.contexts()
            with torch.no_grad(), keep:
                out = stage(x, targets, self._ntok, **kw)
            return _Live(None if first else x, out, redo=redo)
        if (s, mb) not in self.split:
            return _Live(None if first else x, stage(x, targets, self._ntok, **kw))
        store = SavedStore()
        with store.hooks():
            cap.start()
            out = stage(x, targets, self._ntok, **kw)
        return _Live(None if first else x, out, cap.stop(), store=store)

    def _forward_again(self, s: int, mb: int, live: _Live, first: bool, last: bool) -> None:
        """The recomputation of a split backward: F once more, the saved groups' outputs
        returned by the policy's recompute context, building the graph I and W share."""
        stage, cap = self.stages[s], self.capture[s]
        x = self._columns(self._micro[mb][:, :-1], mb) if first else live.x
        targets = self._targets(mb) if last else None
        setting, stage.recompute = stage.recompute, None  # the whole stage, not per block
        t0 = self.timer.mark()
        live.store = SavedStore()
        try:
            with live.redo, live.store.hooks():
                cap.start()
                live.out = stage(x, targets, self._ntok, positions=self._positions(mb),
                                 docs=self._docs(mb))
                live.kept = cap.stop()
        finally:
            stage.recompute = setting
        live.redo = None
        self._recomputes.append((s, mb, t0, self.timer.mark()))
