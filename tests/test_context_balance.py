"""Context parallel's work per rank with packed documents (plait/parallel/context_balance.py):
the in-document causal pairs each rank's queries attend, under the zigzag split of the whole
sequence and under the document-aware split (every document cut into 2cp chunks). Counted,
no launch; the ring's own count is checked against `document_work` in
tests/test_documents.py."""

import torch

from plait.model.packed import document_ids
from plait.parallel.context_balance import (
    document_split,
    document_work,
    imbalance,
    zigzag_split,
)

EOT = 3


def _long_tailed_rows(s: int, rows: int) -> torch.Tensor:
    """Document ids of `rows` windows of s tokens, document lengths log-normal of mean s/8."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.empty(4 * rows * 8).log_normal_(2.0, 1.0, generator=gen)
    lengths = (lengths * s / 8 / lengths.mean()).round().clamp(min=1).long()
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[: s * rows]
    ids = ids.view(rows, s)
    return ids - ids[:, :1]


def test_document_split_holds_every_token_once_and_is_zigzag_for_one_document():
    cp, s = 4, 64
    x = torch.randint(4, 100, (3, s), generator=torch.Generator().manual_seed(0))
    x[0, [0, 5, 6, 7, 40]] = EOT  # documents of 1 token, and shorter than 2cp
    x[1, 63] = EOT
    docs = document_ids(x, EOT)
    split = document_split(docs, cp)
    assert split.shape == (3, cp, s // cp)
    for row in split:
        assert torch.equal(row.flatten().sort().values, torch.arange(s))
        assert torch.equal(row, row.sort(-1).values)  # ascending within each rank
    assert torch.equal(split[1], zigzag_split(cp, s))  # one document: the zigzag
    assert torch.equal(document_split(torch.zeros(1, s, dtype=torch.long), cp)[0],
                       zigzag_split(cp, s))


def test_document_work_counts_the_pairs_inside_documents():
    """Against the dense mask (same document, key not after the query), per rank."""
    cp, s = 2, 32
    x = torch.randint(4, 100, (2, s), generator=torch.Generator().manual_seed(1))
    x[0, [3, 4, 20]] = EOT
    x[1, [9, 30]] = EOT
    docs = document_ids(x, EOT)
    for split in (zigzag_split(cp, s), document_split(docs, cp)):
        got = document_work(docs, split)
        for r in range(cp):
            want = 0
            for row in range(2):
                pos = split[r] if split.dim() == 2 else split[row, r]
                want += int(((docs[row, pos, None] == docs[row, None, :])
                             & (torch.arange(s)[None, :] <= pos[:, None])).sum())
            assert got[r] == want / 2


def test_document_split_balances_short_documents_where_zigzag_does_not():
    """Long-tailed documents of mean s/8: the zigzag leaves some window's busiest rank well
    above the mean; cutting every document into 2cp chunks keeps each within 3 %."""
    s = 1024
    docs = _long_tailed_rows(s, 16)
    for cp in (2, 4):
        zig = [imbalance(document_work(docs[i:i + 1], zigzag_split(cp, s))) for i in range(16)]
        bal = [imbalance(document_work(docs[i:i + 1], document_split(docs[i:i + 1], cp)))
               for i in range(16)]
        assert max(zig) > 1.15, (cp, zig)
        assert max(bal) < 1.03, (cp, bal)
