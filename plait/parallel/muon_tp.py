"""Muon under tensor parallel: each matrix's slices gathered whole on one owner rank.

Tensor parallel cuts a column-parallel weight's rows and a row-parallel weight's columns
over the tp ranks (plait/parallel/tensor.py); Muon must orthogonalise the whole matrix.
Each step one all-to-all over tp sends every rank's slice of each cut matrix's look-ahead
to the matrix's owner, which joins the slices along the cut axis, runs Newton-Schulz once,
and a second all-to-all returns each rank exactly its slice. Owners: largest Newton-Schulz
work first to the least loaded tp rank. Matrices tp does not cut are orthogonalised where
they are (every rank holds them whole). Both all-to-alls are in the ledger (tag "muon").
"""

from __future__ import annotations

import torch
from torch import nn

from plait import comm
from plait.mesh import ParallelMesh
from plait.muon import orthogonalise
from plait.placement import PlacementTable

TP = "tp"  # the mesh dim whose slices are joined


class TensorParallelMuon:
    """The cut matrices among Muon's (by index in the optimizer's parameter list)."""

    def __init__(self, params: dict[int, nn.Parameter], placements: PlacementTable,
                 mesh: ParallelMesh):
        self.mesh, self.n, self.me = mesh, mesh.size(TP), mesh.coord(TP)
        self.axis: dict[int, int] = {}  # index -> the cut axis
        self.whole: dict[int, tuple[int, ...]] = {}  # index -> the whole matrix's shape
        for i, p in params.items():
            splits = [s for s in placements.of(p).splits if s.dim == TP]
            shape = list(p.shape)
            for s in splits:
                if s.replicas != 1 or s.full_size != p.shape[s.axis] * self.n:
                    raise ValueError(f"Muon joins equal tp slices; parameter {tuple(p.shape)} "
                                     f"is cut unevenly over tp (replicas {s.replicas})")
                self.axis[i], shape[s.axis] = s.axis, s.full_size
            self.whole[i] = tuple(shape)
        load = [0.0] * self.n
        self.owner: dict[int, int] = {}
        for i in sorted(self.axis, key=lambda i: -_work(self.whole[i])):
            self.owner[i] = min(range(self.n), key=lambda r: (load[r], r))
            load[self.owner[i]] += _work(self.whole[i])
        self.load = load

    def select(self, ids: list[int]) -> _Selected:
        """The matrices `ids` (the step's, in its order) as muon_update's `sliced`."""
        return _Selected(self, ids)


class _Selected:
    def __init__(self, tp: TensorParallelMuon, ids: list[int]):
        self.tp, self.ids = tp, ids
        self.shapes = [tp.whole[i] for i in ids]

    def orthogonalise(self, looks: list[torch.Tensor], dtype: torch.dtype
                      ) -> list[torch.Tensor]:
        tp, out = self.tp, [None] * len(looks)
        self.dtype = dtype
        cut = [(k, i) for k, i in enumerate(self.ids) if i in tp.axis]
        for k, i in enumerate(self.ids):
            if i not in tp.axis:  # whole on every rank
                out[k] = orthogonalise(looks[k], dtype)
        by_owner = [[(k, i) for k, i in cut if tp.owner[i] == o] for o in range(tp.n)]
        mine = by_owner[tp.me]
        send = [looks[k].reshape(-1) for o in range(tp.n) for k, _ in by_owner[o]]
        in_splits = [sum(looks[k].numel() for k, _ in by_owner[o]) for o in range(tp.n)]
        each = sum(looks[k].numel() for k, _ in mine)  # every rank's slices are alike
        gathered = _exchange(tp.mesh, send, looks, [each] * tp.n, in_splits)
        back = self._owned(mine, looks, gathered)
        result = _exchange(tp.mesh, back, looks, in_splits, [each] * tp.n)
        at = 0
        for o in range(tp.n):
            for k, _ in by_owner[o]:
                out[k] = result[at:at + looks[k].numel()].view_as(looks[k])
                at += looks[k].numel()
        return out

    def _owned(self, mine, looks, gathered) -> list[torch.Tensor]:
        """The owner's matrices joined from every rank's slice, orthogonalised, cut again:
        the flat pieces to send, by destination rank then matrix."""
        tp, parts, at = self.tp, [[] for _ in mine], 0
        for _r in range(tp.n):
            for j, (k, _) in enumerate(mine):
                parts[j].append(gathered[at:at + looks[k].numel()].view_as(looks[k]))
                at += looks[k].numel()
        whole = [orthogonalise(torch.cat(ps, dim=tp.axis[i]), self.dtype)
                 for ps, (_, i) in zip(parts, mine, strict=True)]
        return [w.narrow(tp.axis[i], r * looks[k].shape[tp.axis[i]],
                         looks[k].shape[tp.axis[i]]).reshape(-1)
                for r in range(tp.n) for w, (k, i) in zip(whole, mine, strict=True)]


def _exchange(mesh: ParallelMesh, parts: list[torch.Tensor], like: list[torch.Tensor],
              out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    dtype, device = like[0].dtype, like[0].device
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
    out = torch.empty(sum(out_splits), dtype=dtype, device=flat.device)
    comm.all_to_all(out, flat, mesh, TP, out_splits, in_splits, tag="muon")
    return out


def _work(shape: tuple[int, ...]) -> float:
    m, n = sorted(shape[-2:])
    return float(m * m * n)
