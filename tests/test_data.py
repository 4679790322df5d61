"""Token data: layout-independent global batches, resumption, bad files refused."""

import json

import numpy as np
import pytest
import torch

from plait.train.data import DataError, GlobalBatches, TokenFile, write_token_file


@pytest.fixture
def tokens(tmp_path):
    return write_token_file(tmp_path / "t.bin", np.arange(10_000) % 300, 300)


def test_dp_slices_tile_the_global_batch(tokens):
    b = GlobalBatches(TokenFile.open(tokens), seq_len=16, global_batch=8, seed=3, vocab_size=300)
    for step in (0, 5, 200):  # 200 is past the first epoch (624 windows / 8 per step = 78)
        whole = b.rows(step)
        assert whole.shape == (8, 17)
        for dp in (1, 2, 4, 8):
            parts = torch.cat([b.local_batch(step, r, dp) for r in range(dp)])
            assert torch.equal(parts, whole)
        # inputs and targets are consecutive tokens of the file
        step_by_one = (whole[:, 1:] - whole[:, :-1]) % 300
        assert torch.equal(step_by_one, torch.ones(8, 16, dtype=torch.long))


def test_resumable_and_seeded(tokens):
    a = GlobalBatches(TokenFile.open(tokens), 16, 8, seed=3, vocab_size=300)
    b = GlobalBatches(TokenFile.open(tokens), 16, 8, seed=3, vocab_size=300)
    c = GlobalBatches(TokenFile.open(tokens), 16, 8, seed=4, vocab_size=300)
    assert torch.equal(a.rows(42), b.rows(42))  # a fresh loader resumes at any step
    assert not torch.equal(a.rows(42), c.rows(42))
    # one epoch visits every window exactly once
    seen = [w for s in range(78) for w in a.window_ids(s)]
    assert len(set(seen)) == len(seen) == 624


def test_ids_beyond_vocabulary_refused(tokens):
    with pytest.raises(DataError, match="token id 299 .* vocabulary has 256 ids"):
        GlobalBatches(TokenFile.open(tokens), 16, 8, seed=0, vocab_size=256)


def test_too_little_data_and_missing_files(tmp_path, tokens):
    with pytest.raises(DataError, match="fewer than one global batch"):
        GlobalBatches(TokenFile.open(tokens), 16, 1000, seed=0, vocab_size=300)
    with pytest.raises(DataError, match="plait data prepare"):
        TokenFile.open(tmp_path / "nope.bin")
    meta = json.loads(tokens.with_suffix(".json").read_text())
    meta["num_tokens"] += 1
    tokens.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="prepare it again"):
        TokenFile.open(tokens)


def test_write_is_atomic_and_checks_ids(tmp_path):
    with pytest.raises(DataError, match="outside the vocabulary"):
        write_token_file(tmp_path / "bad.bin", [1, 2, 999], 300)
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
    big = write_token_file(tmp_path / "big.bin", [70_000, 1], 100_000)
    assert json.loads(big.with_suffix(".json").read_text())["dtype"] == "uint32"
    assert TokenFile.open(big).tokens[0] == 70_000
