"""Regional compilation (plait/parallel/compile.py): one launch that compiles every block
beside ZeRO-3, tp + SP with async TP's rings, a 1F1B pipeline, ring context parallel,
MoE over ep and full recomputation, in parity with the single-process run, every block of
a rank on one compiled graph; and what `--compile` refuses.

The launch traces with `aot_eager` (dynamo and AOTAutograd, where compilation meets
plait's hooks, collectives and autograd; inductor's code generation would cost minutes on
two cores): benchmarks/speedups_cpu.py checks inductor's parity with the single-process
run for named layouts and times both (docs/results/speedups.md)."""

import pytest
from helpers import _train_rank, config, reference, token_file
from matrix import parse

from plait.config import load_config
from plait.launch.forked import run_ranks
from plait.testing import assert_parity, merge_ranks

ROW = "z3 tp2 sp pp2:1f1b cp2:ring moe ep2 rc"  # 8 ranks
STEPS = 3
COMPILE = ("parallel.async_tp=true", "train.compile=true", "train.compile_backend=aot_eager")


def _rank(rank: int, world: int, sets: list[str]) -> dict:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from plait.model.transformer import Block

    out = _train_rank(rank, world, sets)
    out["graphs"] = len(_debug_get_cache_entry_list(Block.forward.__code__))
    return out


@pytest.mark.slow  # compile's first step: ~40 s on CPU
def test_compiled_blocks_parity_and_one_graph_a_block_kind():
    sets = [*parse(ROW)["sets"], f"train.steps={STEPS}", *COMPILE]
    token_file()
    outs = run_ranks(_rank, config(*sets).parallel.world_size, sets)
    assert_parity(merge_ranks(outs), reference(*parse(ROW)["model"], f"train.steps={STEPS}"),
                  "fp64")
    # every block is a MoE block here, two a rank: both run one compiled graph (dynamo
    # would compile one per layer if it traced the collectives and their per-layer tags)
    assert [o["graphs"] for o in outs] == [1] * len(outs)


@pytest.mark.parametrize("sets, words", [
    (("parallel.pp=2", "parallel.schedule=zb-h1", "train.compile=true"), "one autograd node"),
    (("train.compile_backend=tensorrt",), "use one of inductor, aot_eager, eager"),
])
def test_refused(sets, words):
    problems = load_config(sets=["model.n_layers=4", "model.tie_embeddings=false",
                                 *sets]).validate()
    assert any(words in p for p in problems), problems
