"""Packed documents (`train.documents`, plait/model/packed.py): attention causal within each
document and never across one, positions restarting per document, no loss across a
boundary; without context parallel and in each cp mode, against an independent reference
that runs every document as a sequence of its own (plait/train/reference.py,
`documents_loss`)."""


import pytest
import torch
from helpers import END_OF_DOCUMENT, batches_for, config, documents_file

from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.packed import IGNORE, document_ids, document_positions, masked_targets
from plait.parallel.context_balance import document_split, document_work, zigzag_split
from plait.testing import assert_parity, merge_ranks
from plait.train.data import DataError, GlobalBatches, TokenFile, write_token_file
from plait.train.loop import TrainOptions, full_state, train
from plait.train.reference import reference_run

EOT = END_OF_DOCUMENT
DOCS = ("train.documents=true", "train.steps=3")


def _rank(rank, world, sets):
    cfg = config(*sets).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    result = train(cfg, mesh, batches_for(cfg), TrainOptions(capture_first_grads=True))
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
    documents_file()  # made once, before the ranks fork
    outs = run_ranks(_rank, cfg.parallel.world_size, [*DOCS, *sets])
    model = [x for x in sets if x.startswith("model.")]
    ref = reference_run(config(*DOCS, *model), batches_for(cfg))
    precision = "fp64"
    assert_parity(merge_ranks(outs), ref, precision)


def test_a_file_without_boundaries_is_refused(tmp_path):
    path = write_token_file(tmp_path / "plain.bin", list(range(4000)) * 2, 4000)
    cfg = config(*DOCS)
    batches = GlobalBatches(TokenFile.open(path), 32, 8, 0, 4000)
    with pytest.raises(DataError, match="records no end-of-document token.*without --documents"):
        batches.end_of_document()
    assert cfg.validate(1) == []


def _at(t, pos):
    """t (b, h, s, d) at sequence indices pos: (L,) for every row or (b, L) per row."""
    return t[:, :, pos] if pos.dim() == 1 else torch.stack([t[r, :, p] for r, p in
                                                            enumerate(pos)])


def _core_with_documents(rank, world, mode):
    """Per split (the zigzag chunks; split by documents, not for a2a): the worst error of
    out/dq/dk/dv, the ring's counted work, and `document_work`'s count for this rank."""
    from plait.config import load_config
    from plait.model.rope import Positions
    from plait.parallel.context import ContextLayout, ContextParallelAttention

    mesh = ParallelMesh.build(load_config(sets=[f"parallel.cp={world}"]).parallel)
    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 32, 8
    q, k, v, dout = (torch.randn(b, h, s, d, generator=gen) for _ in range(4))
    x = torch.randint(4, 256, (b, s), generator=gen)
    x[0, [3, 4, 20]] = EOT  # documents of 4, 1, 16, 11 tokens in row 0; 3 in row 1
    x[1, [9, 30]] = EOT
    docs, me, lay = document_ids(x, EOT), mesh.coord("cp"), ContextLayout(world, s)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.zeros_like(q)
    for row in range(b):  # each document alone, plain causal attention
        for doc in docs[row].unique():
            at = (docs[row] == doc).nonzero().flatten()
            ref[row, :, at] = torch.nn.functional.scaled_dot_product_attention(
                *(t[row, :, at] for t in full), is_causal=True)
    ref.backward(dout)
    found = []
    for by_documents in (False, True) if mode != "a2a" else (False,):
        split = document_split(docs, world) if by_documents else zigzag_split(world, s)
        pos = split[:, me] if by_documents else split[me]
        core = ContextParallelAttention(mesh, lay, mode, by_documents=by_documents)
        mine = [_at(t, pos).clone().requires_grad_() for t in (q, k, v)]
        out = core(*mine, Positions(pos, torch.zeros(1), torch.zeros(1), docs))
        out.backward(_at(dout, pos))
        errs = [(out - _at(ref, pos)).abs().max()]
        errs += [(a.grad - _at(r.grad, pos)).abs().max()
                 for a, r in zip(mine, full, strict=True)]
        found.append((max(float(e) for e in errs), core.ring.work,
                      float(document_work(docs, split)[me])))
    return found


@pytest.mark.parametrize("mode", ["ring", "allgather", "a2a"])
def test_core_attends_within_documents(mode):
    """The core alone on 4 ranks against each document run by itself (plain causal SDPA),
    with the zigzag chunks and split by documents: outputs and dq/dk/dv within 1e-5; the
    ring counts as its work the pairs inside documents only (blocks without one are
    skipped), each rank its own share (`document_work`)."""
    for rank in run_ranks(_core_with_documents, 4, mode):
        for err, work, visible in rank:
            assert err <= 1e-5, (mode, err)
            if mode == "ring":
                assert work == visible


def test_eval_with_documents_equals_each_document_alone():
    """`plait eval --documents` (one rank): the mean loss over the windows' kept targets
    equals the reference's, each document run by itself, on the same weights."""
    from plait.model.transformer import build_model
    from plait.train.evaluate import evaluate
    from plait.train.reference import documents_loss

    cfg = config(*DOCS, "train.global_batch=4").check(1)
    data = TokenFile.open(documents_file())
    got = evaluate(cfg, ParallelMesh.build(cfg.parallel), data, 8)["loss"]
    s = cfg.train.seq_len
    rows = torch.stack([torch.from_numpy(data.tokens[w * s:w * s + s + 1].astype("int64"))
                        for w in range(8)])
    with torch.no_grad():
        want = documents_loss(build_model(cfg.model, seed=cfg.train.seed), rows, EOT)
    assert got == pytest.approx(float(want), rel=1e-5)
