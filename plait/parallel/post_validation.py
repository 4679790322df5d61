"""The optimizer step without a barrier: optimistic update, validated later, rolled back.

With `parallel.optimizer_sync = "barrier"` a pipeline step ends with one all-reduce over
the world (the global grad norm, for clipping and the non-finite check) before any rank
updates, so no rank starts the next step's forwards before the last rank has finished its
backward: ZB-H2's and ZB-V's parallelogram collapses to ZB-H1's bubble. Post-validation
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 4 and appendix C)
removes that barrier:

1. `begin`, as soon as this rank's gradients are final: its share of the squared norm is
   summed over its own stage's ranks (tp, then the replica axes: they finish the step
   together), and that stage partial, with the stage's share of the logged loss, is sent to every
   other pp rank (ledgered p2p, tag "post_validation"; posted, not waited for). Then the
   stage updates at once, optimistically assuming no clipping and finite gradients, after
   a copy of what the update changes (masters, moments, the update count). If its own
   partial already proves the check fails (it is not finite, or alone needs clipping) it
   does not update yet.
2. The next step's forwards start on these parameters. At the rank's *cut* (the end of
   its forward-only prefix, closed under matching transfers: `speculative_prefix` in
   plait/schedule/lower.py) the runtime calls `at_cut`: the other stages'
   partials are waited for and summed in pp order, the same on every rank. A squared
   norm is non-finite exactly when some gradient element is (the barrier's test).
3. Check passed (finite, clip coefficient exactly 1): the copy is dropped. The update was
   the barrier's update, bit for bit (`grad_scale` 1.0 is no multiplication).
   Check failed (the same verdict on every rank): the copy is restored (exact), the update
   redone with the clip coefficient, or skipped for a non-finite norm (as the barrier
   does); then every rank drains its prefix's transfers and runs the step again from its
   first action (the forwards used the wrong weights). Rollbacks are counted in the
   metrics (`rolled_back`) and the summary.

The cost: a copy of the optimizer state between the update and the check (12 bytes a
parameter of this rank, counted as optimizer memory), the gradients held into the next
step's forwards, and, when a check fails, the redone forward prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait import comm
from plait.comm.ops import Handle
from plait.dims import REPLICAS
from plait.mesh import ParallelMesh
from plait.optim import clip_coefficient  # the barrier's coefficient


@dataclass
class Outcome:
    """One step's validated verdict: what the barrier would have logged and done."""
    grad_norm: float
    loss: float
    skipped: bool  # non-finite norm: no update (the barrier's skip)
    rolled_back: bool  # the optimistic update was undone (and redone or skipped)
    deferred: bool  # this stage's own partial proved the check would fail: no update yet


@dataclass
class _Pending:
    step: int
    lr: float
    mine: torch.Tensor  # this stage's (squared norm, loss), float64
    theirs: dict[int, torch.Tensor]  # pp coordinate -> that stage's message
    handles: list[Handle]
    stepped: bool


class PostValidation:
    """Drives a GradSyncOptimizer (plait/parallel/optimizer.py) that has `local_sq_norm`,
    `snapshot`, `restore` and `drop_snapshot` through post-validated steps."""

    def __init__(self, optimizer, mesh: ParallelMesh, grad_clip: float):
        self.opt, self.mesh, self.grad_clip = optimizer, mesh, grad_clip
        self.pending: _Pending | None = None
        self.outcomes: dict[int, Outcome] = {}
        self.rollbacks = 0

    def begin(self, step: int, lr: float, loss_sum: torch.Tensor) -> None:
        """Step `step`'s gradients are final: send this stage's partial to the other pp
        ranks and update optimistically (see the module docstring). `loss_sum`: this
        rank's summed loss (float64, (1,)). Collective over tp and the replica axes (this stage)."""
        if self.pending is not None:
            raise RuntimeError(f"step {self.pending.step} was never validated")
        sq = self.opt.local_sq_norm()
        comm.all_reduce(sq, self.mesh, "tp", tag="grad_norm")
        # the logged loss is summed over the replica axes, not tp (every tp rank holds it)
        mine = torch.cat([sq, loss_sum.to(sq)])
        comm.all_reduce(mine, self.mesh, REPLICAS, tag="grad_norm")
        pp, me = self.mesh.size("pp"), self.mesh.coord("pp")
        peers = self.mesh.group_ranks["pp"]
        theirs = {q: torch.empty_like(mine) for q in range(pp) if q != me}
        handles = comm.batch_send_recv([(mine, peers[q]) for q in theirs],
                                       [(buf, peers[q]) for q, buf in theirs.items()],
                                       self.mesh, "pp", tag="post_validation")
        stage_sq = float(mine[0])
        # this stage alone already fails the check: the global norm is at least its own
        doomed = not math.isfinite(stage_sq) or self._clip(stage_sq) < 1.0
        if not doomed:
            self.opt.snapshot()
            self.opt.step(lr, grad_scale=1.0)
        self.pending = _Pending(step, lr, mine, theirs, handles, stepped=not doomed)

    def at_cut(self) -> bool:
        """The runtime's hook at this rank's cut of the next step: validate the pending
        update; True when every rank must run the step again (the check failed)."""
        out = self.validate()
        return out.rolled_back or out.deferred or out.skipped

    def validate(self) -> Outcome:
        """Wait for the other stages' partials and settle the pending update (see the
        module docstring); the gradients are dropped. The same verdict on every rank."""
        p = self.pending
        if p is None:
            raise RuntimeError("nothing to validate")
        for h in p.handles:
            h.wait()
        parts = [p.theirs.get(q, p.mine) for q in range(self.mesh.size("pp"))]
        sq = sum(float(m[0]) for m in parts)  # in pp order: the same sum on every rank
        norm = math.sqrt(sq) if sq >= 0 else float("nan")
        finite = math.isfinite(norm)
        coef = self._clip(sq) if finite else 0.0
        passed = finite and coef == 1.0
        if p.stepped and passed:
            self.opt.drop_snapshot()
        elif p.stepped:
            self.opt.restore()
            self.rollbacks += 1
        if not passed and finite:
            self.opt.step(p.lr, grad_scale=coef)
        self.opt.zero_grad()
        out = Outcome(norm, sum(float(m[1]) for m in parts), skipped=not finite,
                      rolled_back=p.stepped and not passed, deferred=not p.stepped)
        self.outcomes[p.step] = out
        self.pending = None
        return out

    def _clip(self, sq: float) -> float:
        return clip_coefficient(math.sqrt(sq), self.grad_clip)
