"""Muon's state in checkpoints: each matrix's momentum (the other parameters' AdamW moments)
saved by one layout and read into another; the resumed run continues within the fp64
parity of the uninterrupted single-process reference Muon, which it cannot with the
momentum lost or misplaced."""

import pytest
from helpers import reference
from test_checkpoint import LAYERS, _full, _losses, _params, _run

from plait.testing import assert_parity

MUON = ("train.optimizer=muon", "train.muon_ns_dtype=fp64", "model.tie_embeddings=false")
MOE = ("model_name=tiny-moe", "model.n_layers=2")
PAIRS = [
    # ZeRO-1's flat shards (matrices cut) -> one rank, whole tensors
    ((*MUON, "parallel.dp=2", "parallel.zero=1", "parallel.bucket_mb=0.1"), MUON),
    # replicated over dp -> ZeRO-3 with pp
    ((*MUON, "parallel.dp=2"), (*MUON, "parallel.dp=2", "parallel.zero=3", "parallel.pp=2",
                                "parallel.microbatches=2")),
    # experts sharded over their own group -> replicated
    ((*MUON, *MOE, "parallel.dp=4", "parallel.ep=2", "parallel.zero=1"),
     (*MUON, *MOE, "parallel.dp=2")),
]


@pytest.mark.parametrize("src, dst", PAIRS, ids=["z1-single", "dp2-z3pp2", "moe-ep2z1-dp2"])
def test_muon_checkpoint_reshards_and_continues_within_parity(src, dst):
    full, d = _full(src)
    res = _run(dst, {"resume": str(d / "step-00000002")})
    losses, norms = _losses(full)
    new_losses, new_norms = _losses(res)
    run = {"losses": losses[:2] + new_losses, "grad_norms": norms[:2] + new_norms,
           "params": _params(res)}
    assert_parity(run, reference(LAYERS, *(s for s in src if not s.startswith("parallel."))),
                  "fp64")
