"""Packed documents (`train.documents`, plait/model/packed.py): attention causal within each
document and never across one, positions restarting per document, no loss across a
boundary; without context parallel and in each cp mode, against an independent reference
that runs every document as a sequence of its own (plait/train/reference.py,
`documents_loss`)."""

from functools import cache

import pytest
import torch
from helpers import SESSION_ROOT, config

from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.packed import IGNORE, document_ids, document_positions, masked_targets
from plait.testing import assert_parity, merge_ranks
from plait.train.data import DataError, GlobalBatches, TokenFile, write_token_file
from plait.train.loop import full_state, train
from plait.train.reference import reference_run

EOT = 3
DOCS = ("train.documents=true", "train.steps=3")


@cache
def documents_file():
    """Documents of 1 to 40 tokens (the windows of 32 hold several, and cut some), each
    ended by EOT; no other EOT."""
    gen = torch.Generator().manual_seed(11)
    ids = []
    while len(ids) < 20_000:
        n = int(torch.randint(1, 41, (1,), generator=gen))
        doc = torch.randint(4, 256, (n,), generator=gen)
        doc[1::2] = (doc[::2][: len(doc[1::2])] * 7) % 252 + 4  # learnable pairs
        ids += [*doc.tolist(), EOT]
    return write_token_file(SESSION_ROOT / "documents.bin", ids, 256,
                            {"end_of_document": EOT})


def _batches(cfg):
    return GlobalBatches(TokenFile.open(documents_file()), cfg.train.seq_len,
                         cfg.train.global_batch, cfg.train.seed, cfg.model.vocab_size)


def _rank(rank, world, sets):
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, _batches(cfg), capture_first_grads=True)
    return {"losses": result.losses, "grad_norms": [m["grad_norm"] for m in result.metrics],
            "first_grads": result.first_grads, "metrics": result.metrics,
            "params": full_state(result.model, result.optimizer, mesh, result.placements)}


def test_ids_positions_and_targets():
    x = torch.tensor([[5, 6, EOT, 7, EOT, EOT, 8, 9]])
    assert document_ids(x, EOT).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert document_positions(document_ids(x, EOT)).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    y = torch.arange(8).unsqueeze(0)
    assert masked_targets(x, y, EOT).tolist() == [[0, 1, IGNORE, 3, IGNORE, IGNORE, 6, 7]]


@pytest.mark.parametrize("sets", [
    ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true"],
    ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.pp=2", "parallel.schedule=zb-v",
     "train.recompute=full", "model.n_layers=4", "model.tie_embeddings=false"],
    ["parallel.cp=2", "parallel.cp_mode=allgather", "parallel.dp=2", "parallel.zero=3"],
    ["parallel.cp=4", "parallel.cp_mode=a2a"],
    ["parallel.cp=4", "parallel.cp_mode=hierarchical", "parallel.cp_a2a=2"],
], ids=lambda s: ",".join(x.split(".", 1)[1] for x in s))
def test_parity_with_each_document_run_alone(sets):
    cfg = config(*DOCS, *sets)
    outs = run_ranks(_rank, cfg.parallel.world_size, [*DOCS, *sets])
    model = [x for x in sets if x.startswith("model.")]
    ref = reference_run(config(*DOCS, *model), _batches(cfg))
    precision = "fp32-context" if cfg.parallel.cp > 1 else "fp32-tp"
    assert_parity(merge_ranks(outs), ref, precision)


def test_a_file_without_boundaries_is_refused(tmp_path):
    path = write_token_file(tmp_path / "plain.bin", list(range(4000)) * 2, 4000)
    cfg = config(*DOCS)
    batches = GlobalBatches(TokenFile.open(path), 32, 8, 0, 4000)
    with pytest.raises(DataError, match="records no end-of-document token.*without --documents"):
        batches.end_of_document()
    assert cfg.validate(1) == []
