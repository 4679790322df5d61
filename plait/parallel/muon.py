"""Muon on ZeRO's flat shards: each matrix orthogonalised whole, once, on one owner rank.

ZeRO (plait/parallel/zero.py) holds each unit's parameters flat, rank r owning elements
[r k, (r + 1) k): a matrix is cut wherever the shard boundaries fall. Each step:

1. every rank updates the momentum of its pieces of each Muon matrix and forms the
   Nesterov look-ahead there (element-wise, like AdamW's moments);
2. one all-to-all over the unit's shard group sends each piece to its matrix's owner, who
   puts the pieces in rank order (shards are contiguous, so that is the matrix);
3. the owner runs Newton-Schulz once per matrix (an expert stack: each expert's matrix);
4. a second all-to-all sends each rank exactly its pieces of the orthogonalised matrices;
5. each rank applies the decayed, scaled update to its master pieces; AdamW updates the
   other elements of its shard as usual.

Owners are chosen per shard group by the iteration's work, largest matrix first to the
least loaded rank (LPT): the largest and the mean work per rank stay close (`balance`).
Both all-to-alls go through plait/comm (the ledger, tag "muon").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait import comm
from plait.mesh import ParallelMesh
from plait.muon import MuonSettings, is_muon_matrix, orthogonalise, update_scale
from plait.optim import adamw_update, decays
from plait.parallel.zero_units import _Unit


@dataclass
class _Matrix:
    """One matrix (an expert's, for a stack) of a unit: its elements [start, stop) of the
    unit's flat buffer, its shape, its owner rank in the unit's shard group."""

    unit: _Unit
    start: int
    stop: int
    shape: tuple[int, int]
    owner: int = 0

    def piece(self, rank: int) -> tuple[int, int]:
        """[a, b) of this matrix held by shard `rank`, in the matrix's own coordinates."""
        k = self.unit.k
        a, b = max(self.start, rank * k), min(self.stop, (rank + 1) * k)
        return (a - self.start, b - self.start) if a < b else (0, 0)

    def work(self) -> float:
        """Newton-Schulz multiply-adds, up to a constant: m^2 n for an m x n (m <= n)."""
        m, n = sorted(self.shape)
        return float(m * m * n)


def unit_matrices(u: _Unit) -> list[_Matrix]:
    """Muon's matrices among a unit's parameters (plait/muon.py's rule), in unit order."""
    out = []
    for name, p, off in zip(u.names, u.params, u.offsets, strict=True):
        if not is_muon_matrix(name, p):
            continue
        rows, cols = p.shape[-2], p.shape[-1]
        for e in range(p.numel() // (rows * cols)):  # a stack: each expert's matrix
            start = off + e * rows * cols
            out.append(_Matrix(u, start, start + rows * cols, (rows, cols)))
    return out


def assign_owners(matrices: list[_Matrix], n: int) -> list[float]:
    """Largest work first, each to the least loaded rank (ties: the lowest); every rank
    computes the same assignment. Returns each rank's work."""
    load = [0.0] * n
    for m in sorted(matrices, key=lambda m: -m.work()):  # a stable sort: a fixed order
        m.owner = min(range(n), key=lambda r: (load[r], r))
        load[m.owner] += m.work()
    return load


class ShardedMuon:
    """Muon's update of ZeRO units (with AdamW for the rest of each shard)."""

    def __init__(self, units: list[_Unit], mesh: ParallelMesh, settings: MuonSettings):
        self.mesh, self.settings = mesh, settings
        self.groups: dict[str, list[_Matrix]] = {}  # shard group dim -> its matrices
        for u in units:
            self.groups.setdefault(u.dim, []).extend(unit_matrices(u))
        self.loads = {d: assign_owners(ms, mesh.size(d)) for d, ms in self.groups.items()}
        # this rank's momentum: Muon's elements of each shard's first-moment buffer, which
        # AdamW uses only for the other elements (no third fp32 state a parameter)
        self.momentum = {id(u): u.exp_avg for u in units}
        for u in units:  # the checkpoints' name for it (zero_index.py's `momentum` state)
            u.momentum = u.exp_avg

    def balance(self) -> dict[str, float]:
        """Per shard group: the largest rank's Newton-Schulz work over the mean."""
        return {d: max(load) / (sum(load) / len(load)) if sum(load) else 1.0
                for d, load in self.loads.items()}

    @torch.no_grad()
    def step(self, units: list[_Unit], lr: float, steps: int, betas: tuple[float, float],
             eps: float, weight_decay: float, grad_scale: float) -> None:
        live = {id(u) for u in units}
        self._adamw_rest(units, lr, steps, betas, eps, weight_decay, grad_scale)
        for dim, matrices in self.groups.items():
            ms = [m for m in matrices if id(m.unit) in live]
            if ms:
                self._muon_group(dim, ms, lr, weight_decay, grad_scale)

    def _adamw_rest(self, units, lr, steps, betas, eps, weight_decay, grad_scale) -> None:
        """AdamW on each shard's elements of the parameters that are not Muon's."""
        views = []  # (master, grad, exp_avg, exp_avg_sq, decays) of each AdamW piece
        for u in units:
            names = dict(zip(map(id, u.params), u.names, strict=True))
            for a, b, p in u.segments():
                if not is_muon_matrix(names[id(p)], p):
                    views.append((u.master[a:b], u.grad_shard[a:b], u.exp_avg[a:b],
                                  u.exp_avg_sq[a:b], decays("", p)))
        if views:
            adamw_update(masters=[v[0] for v in views], grads=[v[1] for v in views],
                         exp_avgs=[v[2] for v in views], exp_avg_sqs=[v[3] for v in views],
                         decayed=[v[0] for v in views if v[4]], step=steps, lr=lr,
                         betas=betas, eps=eps, weight_decay=weight_decay,
                         grad_scale=grad_scale)

    def _lookahead(self, m: _Matrix, rank: int, grad_scale: float) -> torch.Tensor:
        """This rank's piece of the matrix's Nesterov look-ahead; its momentum updated."""
        u, (a, b) = m.unit, m.piece(rank)
        lo = m.start + a - u.lo
        g = u.grad_shard[lo:lo + b - a].to(u.master.dtype)
        if grad_scale != 1.0:
            g = g * grad_scale
        buf = self.momentum[id(u)][lo:lo + b - a]
        mu = self.settings.momentum
        buf.mul_(mu).add_(g)
        return g.add(buf, alpha=mu)

    def _muon_group(self, dim: str, ms: list[_Matrix], lr: float, weight_decay: float,
                    grad_scale: float) -> None:
        n, me = self.mesh.size(dim), self.mesh.coord(dim)
        by_owner = [[m for m in ms if m.owner == o] for o in range(n)]
        mine = by_owner[me]
        send = [self._lookahead(m, me, grad_scale) for o in range(n) for m in by_owner[o]]
        in_splits = [sum(_len(m.piece(me)) for m in by_owner[o]) for o in range(n)]
        out_splits = [sum(_len(m.piece(r)) for m in mine) for r in range(n)]
        dtype, device = ms[0].unit.master.dtype, ms[0].unit.master.device
        flat_in = torch.cat(send) if send else torch.zeros(0, dtype=dtype, device=device)
        gathered = torch.empty(sum(out_splits), dtype=dtype, device=flat_in.device)
        comm.all_to_all(gathered, flat_in, self.mesh, dim, out_splits, in_splits, tag="muon")
        whole = self._orthogonalised(mine, gathered, n)
        back = [whole[i][slice(*m.piece(r))] for r in range(n) for i, m in enumerate(mine)]
        flat_back = torch.cat(back) if back else torch.zeros(0, dtype=dtype, device=device)
        result = torch.empty(sum(in_splits), dtype=dtype, device=flat_in.device)
        comm.all_to_all(result, flat_back, self.mesh, dim, in_splits, out_splits, tag="muon")
        at = 0
        for o in range(n):
            for m in by_owner[o]:
                a, b = m.piece(me)
                lo = m.start + a - m.unit.lo
                master = m.unit.master[lo:lo + b - a]
                if weight_decay:
                    master.mul_(1 - lr * weight_decay)
                master.add_(result[at:at + b - a],
                            alpha=-lr * update_scale(m.shape, self.settings.scale))
                at += b - a

    def _orthogonalised(self, mine: list[_Matrix], gathered: torch.Tensor, n: int
                        ) -> list[torch.Tensor]:
        """The owner's matrices from the pieces (by source rank, then matrix), each
        orthogonalised, flat."""
        pieces: list[list[torch.Tensor]] = [[] for _ in mine]
        at = 0
        for r in range(n):
            for i, m in enumerate(mine):
                size = _len(m.piece(r))
                pieces[i].append(gathered[at:at + size])
                at += size
        return [orthogonalise(torch.cat(p).view(m.shape), self.settings.ns_dtype).reshape(-1)
                for p, m in zip(pieces, mine, strict=True)]


def _len(span: tuple[int, int]) -> int:
    return span[1] - span[0]
