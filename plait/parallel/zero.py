"""ZeRO stages 1, 2 and 3 over the data-parallel dim, as one setting (Rajbhandari et al. 2020).

The model is cut into units: stage 3, each top-level module and each block of a
ModuleList; stages 1 and 2, runs of consecutive such modules of about `parallel.bucket_mb`
(zero_units.py: on gloo a collective's fixed cost outweighs the overlap of per-block
ones, docs/zero.md, "Units"). A unit's
parameters are views into one flat buffer, padded to a multiple of N = dp; rank r owns
elements [r*k, (r+1)*k) of it (k = padded / N) and keeps the fp32 master, Adam momentum and
variance of that shard only: 12 bytes a parameter / N.

- stage 1: during the last micro-batch's backward, each unit's full gradient is
  reduce-scattered as soon as it is complete (overlapping the rest of backward;
  ZERO_REDUCE_SCATTERS_IN_FLIGHT of them in flight); each rank updates its shard; the
  updated shards are all-gathered into the full parameters, each unit's waited on just
  before its next forward (overlapping the forward of the units before it).
- stage 2: as soon as backward completes a unit's gradients (every micro-batch) they are
  reduce-scattered asynchronously and the full gradient is freed; the shard accumulates;
  the all-gather as in stage 1.
- stage 3: the full parameters exist only around use: a unit is all-gathered before its
  forward and again before its backward, and its storage freed after each; the next unit's
  all-gather is issued (prefetch) as soon as the current one is in place, so it overlaps
  compute. Gradients are reduce-scattered as in stage 2. `gather="step"`
  (`parallel.zero3_gather`): a unit once gathered stays so until its stage's last backward
  of the step, one all-gather a unit a step instead of two a micro-batch.
- with pp > 1 every stage accumulates its whole gradients over its micro-batches and
  reduce-scatters each unit once, during the stage's last gradient-writing action (B or W)
  of the step (units never span two stages: zero_units.py), as stage 1 does; stage 3 gathers
  only inside a stage (prefetch stops at its ends), for the backwards that compute an input
  gradient (B, I) and for W (`_weight_roots`), not the embedding's backward, and frees
  what a backward gathered at its end. DualPipe's two copies of a stage
  shard alike, so their gradient shards are summed by a swap with the mirror pp rank
  (`_sum_copies`); the second copy is left out of the norm and of checkpoints.
Padding is zero in every gradient, so it never reaches the maths (Adam leaves it at zero).
`shard_index()` names the shards by parameter and state, padding excluded, and
`held_states()` gives them to checkpoints (zero_index.py).
"""

from __future__ import annotations

import math
import time
from collections import deque
from functools import partial

import torch
from torch import nn

from plait import comm
from plait.config import ZERO_REDUCE_SCATTERS_IN_FLIGHT
from plait.mesh import ParallelMesh
from plait.model.precision import widened
from plait.muon import MuonSettings
from plait.optim import adamw_update, decays, sgd_update
from plait.parallel import zero_fp8
from plait.parallel.backward_graph import in_backward, input_gradient_computed, input_node
from plait.parallel.fp8 import is_float8
from plait.parallel.muon import ShardedMuon
from plait.parallel.replicated import sum_over_world
from plait.parallel.zero_index import NamedShards
from plait.parallel.zero_units import _Unit, make_units
from plait.placement import PlacementTable
from plait.schedule.ir import Schedule

GATHERS = ("microbatch", "step")  # parallel.zero3_gather


class ZeroOptimizer(NamedShards):
    """Sharded AdamW state (stage >= 1), gradients (>= 2) and parameters (3) over `dim`;
    its shards by name, and what checkpoints read and write of them: `NamedShards`."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, stage: int,
                 betas: tuple[float, float], eps: float, weight_decay: float,
                 dim: str = "dp", kind: str = "adamw",
                 placements: PlacementTable | None = None, bucket_mb: float | None = None,
                 gather: str = "microbatch", copies: Schedule | None = None,
                 muon: MuonSettings | None = None):
        """`bucket_mb` (stages 1, 2): consecutive modules share a unit up to about this
        many MB of parameters (`zero_unit_groups`); None: a unit per module, as stage 3.
        `gather` (stage 3): "microbatch" or "step" (module docstring). `copies`: DualPipe's
        schedule, whose chain-1 stages are second copies of the mirror rank's."""
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage {stage}; use 1, 2 or 3")
        if gather not in GATHERS:
            raise ValueError(f"ZeRO-3 gather {gather!r}; use one of {', '.join(GATHERS)}")
        seen: set[int] = set()
        for p in model.parameters():
            if id(p) in seen:
                raise ValueError("ZeRO shards each parameter in one unit: untie embeddings")
            seen.add(id(p))
        self.mesh, self.stage, self.dim = mesh, stage, dim
        # hybrid sharding: the ranks holding copies of this rank's shards (None: no copies);
        # the replicas sum the reduced shards once a step (plait/parallel/replicas/)
        self.replicate = mesh.shard_groups()[1]
        self.placements = placements or PlacementTable()
        self.n, self.rank = mesh.size(dim), mesh.coord(dim)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.kind, self.gather, self.copies = kind, gather, copies
        # a pipeline's stages accumulate whole gradients, reduced once a step
        self.accumulate = mesh.size("pp") > 1
        cap = None if stage == 3 or bucket_mb is None else bucket_mb * 2**20
        # ZeRO-3 under precision fp8: the float8 linears' weights gathered in float8
        fp8 = stage == 3 and any(is_float8(m) for m in model.modules())
        self.units = make_units(model, mesh, self.placements, dim, kind != "sgd", cap, fp8)
        # Muon: each matrix gathered whole on one owner rank (plait/parallel/muon.py)
        self.muon = (ShardedMuon(self.units, mesh, muon or MuonSettings())
                     if kind == "muon" else None)
        self._fp8_stale = fp8  # the float8 shards are cast again before the next gather
        covered = sum(len(u.params) for u in self.units)
        if covered != len(list(model.parameters())):
            raise ValueError("ZeRO units must cover every parameter of the model")
        self.steps = 0
        self._saved: tuple[list[torch.Tensor], int] | None = None  # see `snapshot`
        # reduce-scatters in flight during backward: each holds a unit's flat gradient
        self.max_inflight = ZERO_REDUCE_SCATTERS_IN_FLIGHT
        self._last_microbatch = True
        self._inflight: list[_Unit] = []
        self.by_stage: dict[int, list[_Unit]] = {}
        for u in self.units:
            self.by_stage.setdefault(u.stage, []).append(u)
            u.second_copy = copies is not None and copies.chain_of_stage(u.stage) > 0
        self._reducing = True  # this backward reduce-scatters (set by `before_backward`)
        self._next_rs = dict.fromkeys(self.by_stage, 0)  # per stage, in backward order
        self._touched: set[int] = set()  # stages whose gradients this backward wrote
        self._reduced: set[int] = set()  # stages reduced this step (pp)
        self._release_task = -1  # the backward whose end frees what it gathered
        # (step, unit, forward start, forward end) of recent unit forwards: the prefetch
        # overlap is visible against the ledger's all-gather issue times
        self.forward_times: deque[tuple[int, int, float, float]] = deque(maxlen=4096)
        self._forward_start: dict[int, float] = {}
        self._where = {id(p): u for u in self.units for p in u.params}
        self._index_shards(model)
        self._hook_units(model)

    def _hook_units(self, model: nn.Module) -> None:
        """Every parameter's gradient hook; stages 1, 2: the update's all-gather waited on
        before each unit's forward; stage 3: the gathers around use, and under pp W's."""
        for u in self.units:
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.stage < 3:  # the update's all-gather is waited on before each unit's forward
            by_module: dict[int, list[_Unit]] = {}
            for u in self.units:  # a module with no forward of its own never runs one:
                # `_publish` waits at once
                u.deferred = type(u.module).forward is not nn.Module.forward
                by_module.setdefault(id(u.module), []).append(u)
            for units in by_module.values():
                if units[0].deferred:
                    units[0].module.register_forward_pre_hook(partial(self._published, units))
            return
        for u in self.units:
            u.shard = u.full[u.lo:u.hi].clone()
            self._free(u)
            u.module.register_forward_pre_hook(partial(self._pre_forward, u))
            u.module.register_forward_hook(partial(self._post_forward, u))
        if self.accumulate:  # W's roots: the output of every module owning parameters
            for m in model.modules():
                owners = {id(u): u for u in (self._where[id(p)]
                                             for p in m.parameters(recurse=False))}
                if owners:
                    m.register_forward_hook(partial(self._weight_roots, list(owners.values())))

    # ---- stage 3: gather around use ------------------------------------------------
    def _issue_gather(self, u: _Unit) -> None:
        if u.gathered or u.gather_handle is not None:
            return
        if u.fp8_modules:  # float8 bytes, never the bf16 weight (zero_fp8.py)
            if self._fp8_stale:
                zero_fp8.cast_shards(self.units, self.mesh)
                self._fp8_stale = False
            u.gather_handle = zero_fp8.issue_gather(u, self.mesh)
            return
        u.full.untyped_storage().resize_(u.full.numel() * u.full.element_size())
        # autograd saved views of `full` from forward; refilling it is not a real mutation
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(u.full):
            u.gather_handle = comm.all_gather(u.full, u.shard, self.mesh, u.dim,
                                              async_op=True, tag=f"params:{u.index}")

    def _ensure_gathered(self, u: _Unit) -> None:
        self._issue_gather(u)
        if u.gather_handle is not None:
            u.gather_handle.wait()
            u.gather_handle = None
            if u.fp8_modules:
                zero_fp8.hand_to_linears(u)
        u.gathered = True

    def _free(self, u: _Unit) -> None:
        u.full.untyped_storage().resize_(0)
        if u.fp8_modules:
            zero_fp8.free(u)
        u.gathered = False

    def _release(self, units: list[_Unit]) -> None:
        """Free every one of `units` gathered or being gathered (a gather left in flight
        would read the shard after the update writes it)."""
        for u in units:
            if u.gather_handle is not None:
                self._ensure_gathered(u)
            if u.gathered:
                self._free(u)

    def _neighbour(self, u: _Unit, step: int) -> _Unit | None:
        """The unit `step` after u in forward order, inside u's pipeline stage: another
        stage's unit may not run until the next step (prefetching it would leave its gather
        in flight across the update)."""
        i = u.index + step
        if 0 <= i < len(self.units) and self.units[i].stage == u.stage:
            return self.units[i]
        return None

    def _pre_forward(self, u: _Unit, module, args) -> None:
        self._ensure_gathered(u)
        nxt = self._neighbour(u, 1)
        if nxt is not None and not in_backward():
            self._issue_gather(nxt)  # prefetch: overlaps this unit
        # host time: what the prefetch check needs is the order of issue, not kernel time
        self._forward_start[u.index] = time.perf_counter()

    def _post_forward(self, u: _Unit, module, args, output):
        if in_backward():  # recomputation inside backward: keep the unit gathered
            return output
        self.forward_times.append((self.mesh.ledger.step, u.index,
                                   self._forward_start[u.index], time.perf_counter()))
        if self.gather == "microbatch":
            self._free(u)
        out = output if isinstance(output, torch.Tensor) else None
        node = input_node(args)
        u.takes_input_grad = node is not None
        if out is not None and out.requires_grad:
            out.register_hook(partial(self._pre_backward, u, node))
        return output

    def _pre_backward(self, u: _Unit, node, grad: torch.Tensor) -> None:
        """Before the unit's backward. pp: only one that reads its weights gathers it (a
        unit output is also the root of W's backward, which reads none)."""
        if self.accumulate and not input_gradient_computed(node):
            return
        self._ensure_gathered(u)
        prev = self._neighbour(u, -1)
        if prev is not None and (prev.takes_input_grad or not self.accumulate):
            self._issue_gather(prev)  # prefetch in backward order
        if self.accumulate and self.gather == "microbatch":
            self._release_after_use(u)

    def _weight_roots(self, units: list[_Unit], module, args, output) -> None:
        """pp: a split backward's W starts from each parameter-owning module's output;
        some weight gradients' formulas view the weight (a saved view of it is rebuilt),
        so W gathers the module's units too; the embedding's (token ids in) never."""
        node = input_node(args)
        if in_backward() or node is None or not isinstance(output, torch.Tensor) \
                or not output.requires_grad:
            return
        output.register_hook(partial(self._pre_weight_backward, units, node))

    def _pre_weight_backward(self, units: list[_Unit], node, grad: torch.Tensor) -> None:
        if not input_gradient_computed(node):  # W (B and I gather through `_pre_backward`)
            for u in units:
                self._ensure_gathered(u)

    def _release_after_use(self, u: _Unit) -> None:
        """pp: no reduce-scatter frees a unit in a backward that only accumulates (nor in
        a split backward's I). The unit after u is done once u's output gradient is
        complete (every use of its weights lies on the way to it); what is left gathered
        is freed when this backward ends."""
        nxt = self._neighbour(u, 1)
        if nxt is not None and nxt.gathered:
            self._free(nxt)
        task = torch._C._current_graph_task_id()
        if task != self._release_task:
            self._release_task = task
            torch.autograd.Variable._execution_engine.queue_callback(
                partial(self._release, self.by_stage[u.stage]))

    # ---- stages 1, 2: the update's all-gather, completed where it is needed ------------
    def _published(self, units: list[_Unit], module=None, args=None) -> None:
        for u in units:
            if u.gather_handle is not None:
                u.gather_handle.wait()
                u.gather_handle, u.gather_in = None, None

    def settle(self) -> None:
        """Complete the update's all-gathers still in flight (stages 1, 2 wait on each
        before its unit's next forward): the compute parameters are the updated ones."""
        if self.stage < 3:
            self._published(self.units)

    def release_gathered(self) -> None:
        """Stage 3: free every unit gathered. With gathers once a step a unit stays
        gathered from its forward to its stage's last backward, which an evaluation's
        forwards never reach."""
        if self.stage == 3:
            self._release(self.units)

    # ---- gradients: reduce-scatter as units complete (stage >= 2) ---------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        u = self._where[id(p)]
        self._touched.add(u.stage)
        if not self._reducing:
            return  # accumulating whole gradients: the stage's last backward reduces
        u.ready.add(id(p))
        # launch strictly in backward order (a stage's last unit first): every rank matches
        units, done = self.by_stage[u.stage], self._next_rs[u.stage]
        while done < len(units) and len(units[-1 - done].ready) == len(units[-1 - done].params):
            self._launch_reduce_scatter(units[-1 - done])
            done = self._next_rs[u.stage] = done + 1

    def _flush(self, stage: int) -> None:
        """Launch the stage's units not launched yet (gradients that never came: zeros)."""
        units = self.by_stage[stage]
        for i in range(len(units) - 1 - self._next_rs[stage], -1, -1):
            self._launch_reduce_scatter(units[i])
        self._next_rs[stage] = 0
        self._reduced.add(stage)

    def _launch_reduce_scatter(self, u: _Unit) -> None:
        u.rs_in = u.flat_grad(free=self.stage >= 2)
        if self.stage == 3 and u.gathered and (self.gather == "microbatch"
                                               or self._last_microbatch):
            self._free(u)  # its backward is done (of the step's last micro-batch: "step")
        u.rs_out = torch.empty(u.k, dtype=u.rs_in.dtype, device=u.rs_in.device)
        u.rs_handle = comm.reduce_scatter(u.rs_out, u.rs_in, self.mesh, u.dim,
                                          async_op=True, tag="grads")
        u.ready.clear()
        self._inflight.append(u)
        # bound the flat gradients in flight: each holds a whole unit's gradient
        while len(self._inflight) > self.max_inflight:
            self._complete_reduce_scatter(self._inflight.pop(0))

    def _complete_reduce_scatter(self, u: _Unit) -> None:
        u.rs_handle.wait()
        if u.grad_shard is None:  # the step's first reduce-scatter: its output is the shard
            u.grad_shard = u.rs_out
        else:  # stages 2, 3 from the second micro-batch on: accumulate
            u.grad_shard.add_(u.rs_out)
        u.rs_handle, u.rs_out, u.rs_in = None, None, None

    # ---- the step's protocol (GradSyncOptimizer, plait/parallel/optimizer.py) -----------
    def before_backward(self, last_microbatch: bool) -> None:
        """`last_microbatch`: the stage's last backward of the step. Stage 1 and every
        stage under pp reduce during it only; stages 2 and 3 without pp during each."""
        self.settle()  # a unit whose forward did not run: its parameters are read now
        self._last_microbatch = last_microbatch
        self._reducing = last_microbatch or (self.stage >= 2 and not self.accumulate)
        self._touched = set()

    def after_backward(self, last_microbatch: bool) -> None:
        """After each backward: complete this one's reduce-scatters into the shards (stage 1
        and pp: the stage's last one; stages 2, 3 without pp: each); `last_microbatch`: the
        rank's last of the step."""
        if self._reducing:
            for stage in (self._touched if self.accumulate else self.by_stage):
                self._flush(stage)
        if last_microbatch:  # pp: a stage whose last backward wrote no gradient
            for stage in set(self.by_stage) - self._reduced:
                self._flush(stage)
            self._reduced.clear()
        while self._inflight:
            self._complete_reduce_scatter(self._inflight.pop(0))
        if self.stage == 3 and (self.gather == "microbatch" or last_microbatch):
            self._release(self.units)

    def finish_gradients(self) -> None:
        """DualPipe's copies: their gradient shards summed (`_sum_copies`); otherwise
        nothing: the last `after_backward` completed every reduce-scatter."""
        if self.copies is not None:
            self._sum_copies()

    def _sum_copies(self) -> None:
        """Both copies of a stage step with the sum of their gradients. Their units hold
        the same parameters in the same order, padded and sharded alike, so this rank's
        shards and the mirror pp rank's (same dp coordinate) cover the same elements: one
        swap of the shards, 1/N of the whole gradients the replicated optimizer swaps, and
        no whole gradient kept past its reduce-scatter. The sum is the same on both."""
        sched, me = self.copies, self.mesh.coord("pp")
        mirror = self.mesh.group_ranks["pp"][sched.pp - 1 - me]
        order = sorted(self.units, key=lambda u: (sched.model_stage(u.stage), u.index))
        for u in order:
            if u.grad_shard is None:
                u.grad_shard = torch.zeros(u.k, dtype=u.full.dtype, device=u.full.device)
        mine = torch.cat([u.grad_shard for u in order])
        theirs = torch.empty_like(mine)
        for h in comm.batch_send_recv([(mine, mirror)], [(theirs, mirror)], self.mesh, "pp",
                                      tag="pp_copies"):
            h.wait()
        mine += theirs
        for u, part in zip(order, mine.split([u.k for u in order]), strict=True):
            u.grad_shard = part

    def grad_norm(self, summed_with: torch.Tensor | None = None) -> float:
        """Global L2 norm: each shard element once (replicas over other dims skipped);
        `summed_with` rides in its all-reduce (GradSyncOptimizer.grad_norm)."""
        return math.sqrt(float(sum_over_world(self.local_sq_norm(), self.mesh, summed_with)))

    def local_sq_norm(self) -> torch.Tensor:
        """This rank's share of the squared norm (float64, (1,)); summed over the world
        it is the norm squared."""
        total = torch.zeros(1, dtype=torch.float64, device=self.mesh.device.torch)
        if self.replicate is not None and self.mesh.coord(self.replicate):
            return total  # a copy of replicate coordinate 0's shards
        for u in self.units:
            if u.grad_shard is None or u.second_copy:  # a copy's elements count once
                continue
            for a, b, p in u.segments():
                if self.placements.counts_in_norm(p, self.mesh,
                                                  also_sharded=(u.reduced_over,)):
                    total += u.grad_shard[a:b].double().pow(2).sum()
        return total

    # ---- post-validation (plait/parallel/post_validation.py): undo an update exactly ----
    def _state(self) -> list[torch.Tensor]:
        return [t for u in self.units for t in (u.master, u.exp_avg, u.exp_avg_sq)
                if t is not None]

    def snapshot(self) -> None:
        """Copy this rank's master and moment shards and the update count."""
        self._saved = ([t.clone() for t in self._state()], self.steps)

    @torch.no_grad()
    def restore(self) -> None:
        """Back to the `snapshot`; the compute parameters gathered again (collective over
        the shards' dims, like the update)."""
        self.settle()  # fp32: an update's gathers in flight read the masters
        copies, self.steps = self._saved
        for t, c in zip(self._state(), copies, strict=True):
            t.copy_(c)
        self._saved = None
        self._publish()

    def drop_snapshot(self) -> None:
        self._saved = None

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.steps += 1
        units = [u for u in self.units if u.grad_shard is not None]
        if self.kind == "sgd":
            sgd_update([u.master for u in units], [u.grad_shard for u in units], lr, grad_scale)
        elif self.muon is not None:
            self.muon.step(units, lr, self.steps, self.betas, self.eps, self.weight_decay,
                           grad_scale)
        else:
            self._adamw(units, lr, grad_scale)
        self._publish()

    def _adamw(self, units: list[_Unit], lr: float, grad_scale: float) -> None:
        adamw_update(
            masters=[u.master for u in units],
            grads=[u.grad_shard for u in units],
            exp_avgs=[u.exp_avg for u in units], exp_avg_sqs=[u.exp_avg_sq for u in units],
            decayed=[u.master[a:b] for u in units for a, b, p in u.segments()
                     if decays("", p)],
            step=self.steps, lr=lr, betas=self.betas, eps=self.eps,
            weight_decay=self.weight_decay, grad_scale=grad_scale)

    def _publish(self) -> None:
        """The updated shards into the compute parameters (stage 3: its persistent shard)."""
        if self.stage == 3:  # the next forward gathers (what is gathered is out of date)
            self._release(self.units)
            for u in self.units:
                u.shard.copy_(u.master)
            self._fp8_stale = any(u.fp8_modules for u in self.units)
            return
        self.settle()  # one gather at a time into `full`
        for u in self.units:  # all in flight at once; fp32: the input is the master itself
            u.gather_in = u.master.to(u.full.dtype)
            u.gather_handle = comm.all_gather(u.full, u.gather_in, self.mesh, u.dim,
                                              async_op=True, tag="params")
        self._published([u for u in self.units if not u.deferred])

    def replica_gradients(self) -> list[torch.Tensor]:
        """The step's reduced gradient shards, one a unit (zeros where a unit had none):
        what replicas of this rank's shards sum (plait/parallel/fault_tolerance.py)."""
        for u in self.units:
            if u.grad_shard is None:
                u.grad_shard = torch.zeros(u.k, dtype=u.full.dtype, device=u.full.device)
        return [u.grad_shard for u in self.units]

    def zero_grad(self) -> None:
        """Drop every gradient, the shards too: between steps no stage holds gradient
        state, so ZeRO-2's peak (at the first backward, before any reduce-scatter) is never
        above ZeRO-1's by a shard kept zeroed from the last step."""
        for u in self.units:
            for p in u.params:
                p.grad = None
            u.grad_shard = None

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters by name, all-gathered from every rank's master shard."""
        return self._gather_by_name(lambda u: u.master)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full fp32 gradients by name (summed over dp), from every rank's gradient shard;
        call between backward and step()."""
        return self._gather_by_name(lambda u: widened(u.grad_shard) if u.grad_shard is not None
                                    else torch.zeros(u.k, dtype=u.master.dtype,
                                                     device=u.master.device))

    def _gather_by_name(self, shard_of) -> dict[str, torch.Tensor]:
        out = {}
        for u in self.units:
            full = torch.empty(u.k * u.n, dtype=u.master.dtype, device=u.master.device)
            comm.all_gather(full, shard_of(u), self.mesh, u.dim, tag="state")
            for name, p, off in zip(u.names, u.params, u.offsets, strict=True):
                out[name] = full[off:off + p.numel()].view(p.shape).clone()
        return out

    # ---- what the memory tracker counts ---------------------------------------------------
    def memory_sources(self) -> dict[str, list[torch.Tensor]]:
        params = [u.full for u in self.units] + [u.shard for u in self.units if u.shard
                                                 is not None]
        params += [t for u in self.units for t in (u.fp8_shard, u.fp8_full) if t is not None]
        grads = [p.grad for u in self.units for p in u.params if p.grad is not None]
        comm_buffers = [u.rs_in for u in self.units if u.rs_in is not None]
        comm_buffers += [t for u in self.units if u.rs_handle is not None
                         for t in u.rs_handle.buffers]
        # stages 2, 3: the step's first reduce-scatter output becomes the gradient shard
        # (same storage; the tracker keeps a storage's first category), a later one is a
        # temporary added into it; stage 1's gradient state is the full gradient
        for u in self.units:
            if u.rs_out is not None:
                shard_to_be = self.stage >= 2 and u.grad_shard is None
                (grads if shard_to_be else comm_buffers).append(u.rs_out)
        shards = [u.grad_shard for u in self.units if u.grad_shard is not None]
        (comm_buffers if self.stage == 1 else grads).extend(shards)
        optim = [t for u in self.units for t in (u.master, u.exp_avg, u.exp_avg_sq)]
        # the updated shards cast for their all-gather (bf16), until the next forward
        optim += [u.gather_in for u in self.units if u.gather_in is not None]
        optim += list(self._saved[0]) if self._saved is not None else []
        return {"params": params, "grads": grads, "optimizer": optim, "comm": comm_buffers}
