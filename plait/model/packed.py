"""Packed documents: several documents in one training sequence, each on its own.

A token file written by `plait data prepare` ends every document with the end-of-document
token (its metadata's `end_of_document`). With `train.documents` the model treats each
window of the file as the documents it holds, as Megatron-LM's `--reset-position-ids`,
`--reset-attention-mask` and `--eod-mask-loss` do:

* a token after an end-of-document token starts a new document (`document_ids`);
* positions restart at 0 with each document (`document_positions`): RoPE sees the
  position inside the document;
* attention is causal within a document and never crosses one (the cores read the ids);
* the end-of-document token's target (the next document's first token) is not predicted
  (`masked_targets`: the ignore index), and the global batch's mean loss is over the
  targets kept (`kept_targets`).
"""

from __future__ import annotations

import torch

IGNORE = -100  # torch's cross-entropy ignore_index: a target that is never predicted


def document_ids(inputs: torch.Tensor, eot: int) -> torch.Tensor:
    """int64 (b, s): the document of each input token, counted from 0 in each row (the
    end-of-document token belongs to the document it ends)."""
    ends = (inputs == eot).long()
    return torch.cumsum(ends, 1) - ends


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """int64 (b, s): each token's position inside its document."""
    idx = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    starts = torch.cat([torch.ones_like(docs[:, :1], dtype=torch.bool),
                        docs[:, 1:] != docs[:, :-1]], 1)
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 1).values
    return idx - first


def masked_targets(inputs: torch.Tensor, targets: torch.Tensor, eot: int) -> torch.Tensor:
    """The targets with the end-of-document tokens' own (across the boundary) ignored."""
    return targets.masked_fill(inputs == eot, IGNORE)


def kept_targets(rows: torch.Tensor, eot: int) -> int:
    """Targets predicted in (rows, s + 1) token windows: those whose input is not an
    end-of-document token."""
    return int((rows[:, :-1] != eot).sum())


def document_mask(q_docs: torch.Tensor, k_docs: torch.Tensor, q_idx: torch.Tensor,
                  k_idx: torch.Tensor) -> torch.Tensor:
    """bool (b, 1, m, n): key j visible to query i when both are in one document and j is
    not after i in the sequence (`*_idx`: sequence indices, (m,), (n,) or per row (b, m),
    (b, n); `*_docs`: (b, m), (b, n))."""
    same = q_docs.unsqueeze(-1) == k_docs.unsqueeze(-2)
    return (same & (k_idx.unsqueeze(-2) <= q_idx.unsqueeze(-1))).unsqueeze(1)
