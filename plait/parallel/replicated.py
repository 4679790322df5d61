"""ZeRO stage 0: whole, replicated parameters; data-parallel gradient sync + AdamW/SGD.

`ReplicatedOptimizer` is the GradSyncOptimizer (plait/parallel/optimizer.py) for zero = 0;
`TwoCopyOptimizer` is its DualPipe variant, where each rank holds two copies of some
blocks whose gradients must be summed (`sum_copy_gradients`, a swap with the mirror rank)
before the norm and the update. Also here: the
global grad norm over whole (or tp-split) parameters, which both use, and what a checkpoint
reads of them (`held_states`: each parameter's states, whole).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plait import comm
from plait.config import Config
from plait.mesh import ParallelMesh
from plait.model.precision import wide_dtype, widened
from plait.muon import muon_settings
from plait.optim import MixedPrecisionAdamW
from plait.parallel.data import DataParallel
from plait.parallel.expert import reduce_dim
from plait.parallel.held import HeldState
from plait.parallel.muon_tp import TP, TensorParallelMuon
from plait.placement import PlacementTable
from plait.schedule.ir import Schedule


def sum_copy_gradients(stages: dict[int, nn.Module], schedule: Schedule, mesh: ParallelMesh,
                       dim: str = "pp") -> None:
    """DualPipe holds block j on rank j (copy 0) and on rank p-1-j (copy 1); both copies
    must step with the sum of their gradients. Each rank swaps its flat gradients with its
    mirror rank (ledgered send/recv) and adds: the blocks line up once sorted by block."""
    if schedule.num_chains == 1:
        return
    me = mesh.coord(dim)
    mirror = mesh.group_ranks[dim][schedule.pp - 1 - me]
    order = sorted(stages, key=schedule.model_stage)
    params = [p for s in order for p in stages[s].parameters()]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    theirs = torch.empty_like(flat)
    for h in comm.batch_send_recv([(flat, mirror)], [(theirs, mirror)], mesh, dim,
                                  tag="pp_copies"):
        h.wait()
    flat += theirs
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def global_grad_norm(params: list[nn.Parameter], mesh: ParallelMesh,
                     placements: PlacementTable, summed_with: torch.Tensor | None = None
                     ) -> float:
    """L2 norm of the full gradient across the mesh, each parameter element counted once.

    A parameter replicated over a dim contributes only from the rank at coordinate 0 of
    that dim (`placements.counts_in_norm`); the partial sums are then all-reduced once over
    the world. When nothing is sharded every rank already holds the whole gradient and no
    communication is needed. `summed_with`: see GradSyncOptimizer.grad_norm.
    """
    grads = [(p, p.grad) for p in params if p.grad is not None]
    if not placements.any_sharded([p for p, _ in grads]) or mesh.world_size == 1:
        sq = sum(float(widened(g).pow(2).sum()) for _, g in grads)
        if summed_with is not None:  # the norm has no all-reduce to carry it
            comm.all_reduce(summed_with, mesh, "dp", tag="metrics")
        return math.sqrt(sq)
    return math.sqrt(float(sum_over_world(local_sq_norm(params, mesh, placements), mesh,
                                          summed_with)))


def sum_over_world(sq_norm: torch.Tensor, mesh: ParallelMesh,
                   summed_with: torch.Tensor | None = None) -> torch.Tensor:
    """A rank's share of the squared norm (float64, (1,)) summed over the world; with
    `summed_with` (float64, (1,)) beside it in the same all-reduce, summed in place."""
    total = sq_norm if summed_with is None else torch.cat([sq_norm, summed_with.reshape(1)])
    comm.all_reduce(total, mesh, "world", tag="grad_norm")
    if summed_with is not None:
        summed_with.copy_(total[1:].reshape(summed_with.shape))
    return total[:1]


def local_sq_norm(params: list[nn.Parameter], mesh: ParallelMesh,
                  placements: PlacementTable) -> torch.Tensor:
    """This rank's share of the squared global grad norm (float64, shape (1,)), each
    element counted on one rank only; summed over the world it is the norm squared."""
    total = torch.zeros(1, dtype=torch.float64, device=mesh.device.torch)
    for p in params:
        if p.grad is not None and placements.counts_in_norm(p, mesh):
            total += p.grad.double().pow(2).sum()
    return total


def named_local(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """(model name, parameter, owned) of every parameter this rank holds, DualPipe's
    second copies included (owned = False)."""
    if not hasattr(model, "stages"):  # pp == 1: the Transformer, with the model's names
        return [(n, p, True) for n, p in model.named_parameters()]
    return [(n, p, int(s) in model.owned)  # a stage's own names are the model's
            for s, stage in model.stages.items() for n, p in stage.named_parameters()]


class ReplicatedOptimizer:
    """ZeRO stage 0: data-parallel gradient sync + AdamW over whole, replicated parameters.

    A GradSyncOptimizer: DataParallel reduces during the last micro-batch's backward and
    `after_backward(last)` waits for it, so `finish_gradients` has nothing left to do.
    """

    two_copies = False  # TwoCopyOptimizer: the second copies are held, not owned

    def __init__(self, model: nn.Module, mesh: ParallelMesh, cfg: Config,
                 placements: PlacementTable, dim: str = "dp"):
        """`dim`: where gradients are summed ("dp_cp" under context parallel)."""
        t, p = cfg.train, cfg.parallel
        self.model, self.mesh, self.placements = model, mesh, placements
        self.params = [q for q in model.parameters() if q.requires_grad]
        # one sync per reduction dim: expert-parallel slices are summed over "edp"
        by_dim: dict[str, list[nn.Parameter]] = {}
        for q in self.params:
            by_dim.setdefault(reduce_dim(placements, q, dim), []).append(q)
        self.syncs = [DataParallel(model, mesh, mode=p.data_parallel, bucket_mb=p.bucket_mb,
                                   dim=d, params=qs) for d, qs in by_dim.items()]
        named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        self.optim = MixedPrecisionAdamW(named, (t.beta1, t.beta2), t.eps, t.weight_decay,
                                         kind=t.optimizer, muon=muon_settings(t))
        if t.optimizer == "muon" and mesh.size(TP) > 1:  # each cut matrix joined to its owner
            o = self.optim
            o.sliced = TensorParallelMuon({i: o.params[i] for i in o.muon_ids}, placements,
                                          mesh)

    def before_backward(self, last_microbatch: bool) -> None:
        for sync in self.syncs:
            sync.before_backward(last_microbatch)

    def after_backward(self, last_microbatch: bool) -> None:
        if last_microbatch:
            for sync in self.syncs:
                sync.finish()

    def finish_gradients(self) -> None:
        """Nothing: the last backward's `after_backward` already synced over dp."""

    def grad_norm(self, summed_with: torch.Tensor | None = None) -> float:
        return global_grad_norm(self.params, self.mesh, self.placements, summed_with)

    def local_sq_norm(self) -> torch.Tensor:
        """This rank's share of the squared grad norm (post-validation sums it over pp)."""
        return local_sq_norm(self.params, self.mesh, self.placements)

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        self.optim.step(lr, grad_scale)

    def snapshot(self) -> None:
        """Keep a copy of what `step` changes (masters, moments, the update count), for
        `restore` (plait/parallel/post_validation.py)."""
        self.optim.snapshot()

    def restore(self) -> None:
        """Undo the steps since `snapshot`, exactly; the copy is dropped."""
        self.optim.restore()

    def drop_snapshot(self) -> None:
        self.optim.drop_snapshot()

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def replica_gradients(self) -> list[torch.Tensor]:
        """The step's final gradients, zeros where a parameter had none: what replicas of
        this rank's state sum (plait/parallel/fault_tolerance.py)."""
        for q in self.params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        return [q.grad for q in self.params]

    def settle(self) -> None:
        """Nothing: the update writes the parameters in place."""

    def release_gathered(self) -> None:
        """Nothing: every parameter is held whole."""

    def full_state(self) -> dict[str, torch.Tensor]:
        return {n: widened(q.detach()).clone() for n, q in self.model.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        return {n: (widened(q.grad.detach()).clone() if q.grad is not None
                    else torch.zeros(q.shape, dtype=wide_dtype(q.dtype), device=q.device))
                for n, q in self.model.named_parameters()}

    # ---- checkpoints (GradSyncOptimizer: held_states, params_read_on_load, finish_load) ----
    @property
    def steps(self) -> int:
        return self.optim.steps

    def held_states(self) -> list[HeldState]:
        """Each parameter's master (and AdamW's moments), whole, in the model's order."""
        o = self.optim
        index = {id(p): i for i, p in enumerate(o.params)}
        out = []
        for name, p, owned in named_local(self.model):
            i = index[id(p)]
            tensors = {"master": o.master[i], **o.states(i)}
            copy = self.two_copies and not owned
            out.extend(HeldState(name, state, p, 0, p.numel(), t, second_copy=copy)
                       for state, t in tensors.items())
        return out

    def params_read_on_load(self) -> list[tuple[str, nn.Parameter]]:
        """None: `finish_load` casts every parameter from its loaded master."""
        return []

    @torch.no_grad()
    def finish_load(self, steps: int) -> None:
        o = self.optim
        for m, p in zip(o.master, o.params, strict=True):
            if m.data_ptr() != p.data_ptr():  # fp32: the master is the parameter's storage
                p.data.copy_(m)
        o.steps = steps

    def memory_sources(self) -> dict[str, list[torch.Tensor]]:
        o = self.optim
        # fp32: the master is the parameter's own storage, counted once (as a parameter)
        masters = [m for m, q in zip(o.master, o.params) if m.data_ptr() != q.data_ptr()]
        return {"params": list(self.params),
                "grads": [q.grad for q in self.params if q.grad is not None],
                "optimizer": (masters + o.exp_avg + o.exp_avg_sq + o.momentum
                              + o.snapshot_tensors()),
                "comm": [b.flat for sync in self.syncs for b in sync.buckets
                         if b.flat is not None]}


class TwoCopyOptimizer(ReplicatedOptimizer):
    """DualPipe: block j lives on pp rank j (copy 0, *owned*) and on rank p-1-j (copy 1).

    Both copies must step with the sum of their gradients: `finish_gradients` swaps them
    with the mirror rank after the step's backward (not inside it: the runtime may still
    owe the mirror a transfer) and adds; the norm counts the owned copies only, and
    checkpoints write them only (`held_states` marks the others `second_copy`).
    """

    two_copies = True

    def __init__(self, model: nn.Module, mesh: ParallelMesh, cfg: Config,
                 placements: PlacementTable, stages: dict[int, nn.Module], schedule: Schedule,
                 dim: str = "dp"):
        super().__init__(model, mesh, cfg, placements, dim)
        self.stages, self.schedule = stages, schedule
        self.owned = model.owned_parameters()  # PipelineModule: chain 0's stages

    def finish_gradients(self) -> None:
        sum_copy_gradients(self.stages, self.schedule, self.mesh)

    def grad_norm(self, summed_with: torch.Tensor | None = None) -> float:
        return global_grad_norm(self.owned, self.mesh, self.placements, summed_with)

    def local_sq_norm(self) -> torch.Tensor:
        return local_sq_norm(self.owned, self.mesh, self.placements)
