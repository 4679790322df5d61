"""Context parallel's load balance with packed documents: the attention work each of the
`ranks` context-parallel ranks' queries do, and a split of the tokens that balances it.

With packed documents (plait/model/packed.py) query i attends the keys of its own document
up to itself: a query at position p inside its document does p + 1 (query, key) pairs,
whatever the document's place in the sequence. The zigzag split (`ContextLayout`, rank r
holding chunks r and 2cp-1-r of the whole sequence) balances one long causal sequence; with
short documents the pairs follow the documents, not the sequence, and a rank can hold the
long documents' late tokens only (`document_work` counts it).

`document_split` cuts every document instead, as Megatron-Core does for packed sequences
under context parallel (its THD layout, `get_batch_on_this_cp_rank` with `cu_seqlens`):
each document into 2cp chunks of q = n // 2cp tokens, rank r taking chunks r and 2cp-1-r,
so every rank does q²(2cp-1) + q(q+1) pairs of it. Megatron pads each document to a
multiple of 2cp in its data pipeline; plait's windows have a fixed length, so the n mod 2cp
tokens left at each document's end (the remainder) are dealt to the ranks instead, one at
a time in sequence order along the serpentine 0, 1, .., R-1, R-1, .., 0 (R = `ranks`):
their number over a row is a multiple of 2R (seq_len and every document's 2R·q are), so
every rank holds exactly seq_len/R tokens, and a document's remainder (under 2R tokens)
gives a rank at most two of its tokens, each worth under n pairs against the rank's
~n²/2R of it.
"""

from __future__ import annotations

import torch

from plait.model.packed import document_positions


def zigzag_split(ranks: int, seq_len: int) -> torch.Tensor:
    """int64 (ranks, seq_len/ranks): each rank's sequence indices under the zigzag layout
    (chunks r and 2cp-1-r of the whole sequence), the same for every row."""
    c = seq_len // (2 * ranks)
    return torch.stack([torch.cat([torch.arange(r * c, (r + 1) * c),
                                   torch.arange((2 * ranks - 1 - r) * c, (2 * ranks - r) * c)])
                        for r in range(ranks)])


def _mirror(g: torch.Tensor, ranks: int) -> torch.Tensor:
    """Chunk g of 2cp -> its rank: g for the first `ranks` chunks, 2cp-1-g for the rest."""
    return torch.where(g < ranks, g, 2 * ranks - 1 - g)


def document_ranks(docs: torch.Tensor, ranks: int) -> torch.Tensor:
    """int64 (b, s): the rank that holds each token under the document-aware split
    (the module docstring). `docs` (b, s): each token's document (`document_ids`)."""
    k = 2 * ranks
    lengths = torch.zeros_like(docs).scatter_add_(1, docs, torch.ones_like(docs))
    n = lengths.gather(1, docs)
    p = document_positions(docs)
    q = n // k
    main = p < k * q
    chunk = torch.where(main, p // q.clamp(min=1), 0)
    dealt = torch.cumsum((~main).long(), 1) - 1  # the remainder tokens' running count
    return torch.where(main, _mirror(chunk, ranks), _mirror(dealt % k, ranks))


def document_split(docs: torch.Tensor, ranks: int) -> torch.Tensor:
    """int64 (b, ranks, s/ranks): each rank's sequence indices in every row under the
    document-aware split, ascending (a single document gives the zigzag split)."""
    b, s = docs.shape
    if s % (2 * ranks):
        raise ValueError(f"seq_len {s} does not split into 2*ranks={2 * ranks} chunks")
    owner = document_ranks(docs, ranks)
    idx = torch.arange(s, device=docs.device).expand(b, s)
    order = torch.argsort(owner * s + idx, dim=1)  # by rank, then by sequence index
    return order.view(b, ranks, s // ranks)


def document_work(docs: torch.Tensor, split: torch.Tensor) -> torch.Tensor:
    """float64 (ranks,): the in-document causal (query, key) pairs each rank's queries attend,
    a mean over the rows (what the ring counts as `Ring.work`). `split`: (ranks, L) for every
    row alike (`zigzag_split`) or (b, ranks, L) per row (`document_split`)."""
    pairs = (document_positions(docs) + 1).double()  # query at p in its document: p + 1 keys
    b = docs.shape[0]
    split = split.expand(b, *split.shape[-2:]) if split.dim() == 2 else split
    return pairs.gather(1, split.flatten(1)).view(split.shape).sum(-1).mean(0)


def imbalance(work: torch.Tensor) -> float:
    """max / mean of the ranks' work (1.0: balanced)."""
    return float(work.max() / work.mean())
