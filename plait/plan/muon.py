"""What Muon under ZeRO sends, counted from the planner's own ZeRO units.

plait/parallel/muon.py gathers each Muon matrix's pieces on one owner rank of its shard
group with an all-to-all and returns the orthogonalised pieces with a second one. This
rank's payload a step is its pieces of every matrix (the first all-to-all's input) plus
the whole of each matrix it owns (the second's), in the masters' dtype. Counted here from
the units the planner models (plait/plan/runtime_memory_sizes.py), the matrices' shapes
written out from the model's config, and the same rule of owners (largest Newton-Schulz
work first to the least loaded rank). Dense models without tensor parallel only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from plait.dims import REPLICA_AXES
from plait.plan.runtime_memory_sizes import (
    MUON_LAYER_PARAMS,
    _runs,
    _shapes,
    _stage_params,
    rank_stages,
)

if TYPE_CHECKING:
    from plait.config import Config

_BLOCK_MATRICES = MUON_LAYER_PARAMS  # which of a block's parameters are Muon's matrices


def _block_shapes(cfg: Config) -> list[tuple[int, int] | None]:
    # the whole matrices: tp's per-rank key/value width times tp (tp divides the heads)
    h, f, kv = cfg.model.dim, cfg.model.ffn_dim, _shapes(cfg)["k_t"] * cfg.parallel.tp
    return [None, (h, h), (kv, h), (kv, h), (h, h), None, (f, h), (f, h), (h, f)]


def muon_matrices(cfg: Config, pp_rank: int
                  ) -> tuple[list[tuple[int, int, int, tuple[int, int]]], list[int]]:
    """(unit index, first element, end element, shape) of each Muon matrix in this
    pipeline rank's units, in unit order; and each unit's shard elements."""
    if cfg.model.n_experts or cfg.model.mla or cfg.parallel.tp > 1:
        raise ValueError("the planner counts Muon's bytes for dense models without tensor "
                         "parallel only")
    _, stages = rank_stages(cfg, pp_rank)
    n = _shard_group(cfg)
    cap = None if cfg.parallel.zero == 3 else cfg.parallel.bucket_mb * 2 ** 20
    sh, layer = _shapes(cfg), _block_shapes(cfg)
    out, shard = [], []
    for st in sorted(stages):
        for run in _runs(_stage_params(sh, *stages[st]), cap, _element(cfg)):
            at = 0
            for name, numels in run:
                for j, numel in enumerate(numels):
                    if name.startswith("layers.") and j in _BLOCK_MATRICES:
                        out.append((len(shard), at, at + numel, layer[j]))
                    at += numel
            shard.append(-(-at // n))
    return out, shard


def _shard_group(cfg: Config) -> int:
    """Ranks ZeRO shards a unit over: the replica axes' product (data x context)."""
    return math.prod(getattr(cfg.parallel, d) for d in REPLICA_AXES)


def _element(cfg: Config) -> int:
    """Bytes of a master element (what the all-to-alls carry)."""
    return 8 if cfg.train.precision == "fp64" else 4


def muon_payload(cfg: Config, pp_rank: int, dp_rank: int) -> float:
    """Bytes a step this rank's two Muon all-to-alls carry (each call's input)."""
    n = _shard_group(cfg)
    if n == 1:  # one rank a group: nothing sent, nothing ledgered
        return 0.0
    matrices, shard = muon_matrices(cfg, pp_rank)
    owners = _owners([s for _, _, _, s in matrices], n)
    sent = 0
    for (i, a, b, _), owner in zip(matrices, owners, strict=True):
        lo, hi = dp_rank * shard[i], (dp_rank + 1) * shard[i]
        sent += max(0, min(b, hi) - max(a, lo))  # this rank's piece, there
        sent += (b - a) if owner == dp_rank else 0  # the whole, back from its owner
    return float(sent * _element(cfg))


def _owners(shapes: list[tuple[int, int]], n: int) -> list[int]:
    load, owner = [0.0] * n, [0] * len(shapes)
    work = [min(s) ** 2 * max(s) for s in shapes]
    for j in sorted(range(len(shapes)), key=lambda j: -work[j]):
        owner[j] = min(range(n), key=lambda r: (load[r], r))
        load[owner[j]] += work[j]
    return owner


def muon_tp_payload(cfg: Config, pp_rank: int, tp_rank: int) -> float:
    """Bytes a step this rank's two Muon all-to-alls over tensor parallel carry (ZeRO 0):
    its slice of every cut matrix there, and each matrix it owns whole back. Every block
    matrix is cut (tp divides the heads and the feed-forward width)."""
    tp = cfg.parallel.tp
    if tp == 1:
        return 0.0
    if cfg.model.n_experts or cfg.model.mla:
        raise ValueError("the planner counts Muon's tensor-parallel bytes for dense "
                         "models without multi-head latent attention only")
    _, stages = rank_stages(cfg, pp_rank)
    block = [s for j, s in enumerate(_block_shapes(cfg)) if j in _BLOCK_MATRICES]
    shapes = [s for st in sorted(stages) for _ in range(*stages[st][:2]) for s in block]
    owners = _owners(shapes, tp)
    sliced = sum(a * b // tp for a, b in shapes)
    owned = sum(a * b for (a, b), o in zip(shapes, owners, strict=True) if o == tp_rank)
    return float((sliced + owned) * _element(cfg))

