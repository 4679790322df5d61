"""Injected bugs in float8 training (`train.precision = "fp8"`), each caught by its tests
(tests/mutants.py runs them)."""

from __future__ import annotations

from tests.mutant_kit import Mutant

FP8 = "tests/test_fp8.py::"
FP8_PARITY = "tests/test_fp8_parity.py::"


def amax_not_reduced():
    """Each rank scales by its own part of a split tensor: tp's weight shards and
    row-parallel inputs, context parallel's sequence chunks."""
    from plait.parallel import fp8

    fp8.SPLITTING_DIMS = ()


def gradients_in_e4m3():
    """Backward casts the output gradient to E4M3 (range 448) instead of E5M2."""
    from plait.model import fp8

    fp8.E5M2 = fp8.E4M3


def plan_gathers_fp8_at_two_bytes():
    """The planner prices ZeRO-3's float8 weight gathers (and their buffers) at bf16's two
    bytes an element."""
    from plait.plan import memory

    memory.LINEAR_GATHER_BYTES["fp8"] = 2


def plan_fp8_at_the_bf16_peak():
    """The planner prices --precision fp8's weight GEMMs at the bf16 peak and curve."""
    from plait.plan import fp8

    fp8.weight_gemms = lambda *args: None


def block_activations_per_row():
    """Blockwise: an activation (or output gradient) scaled per row of the GEMM, one scale
    a token over all its features, instead of per 1 x B tile."""
    import torch

    from plait.model import fp8_blockwise as fb

    tiled = fb.quantize_rows

    def per_row(t, block):
        q, inv = tiled(t, block)
        row = fb.scale_for(fb.widened(t).abs().amax(-1, keepdim=True), fb.E4M3)
        padded = fb._pad_to(fb.widened(t), 1, block).view(q.shape)
        return fb.to_fp8(padded, row[..., None], fb.E4M3), torch.ones_like(inv) / row

    fb.quantize_rows = per_row


def block_weights_per_tensor():
    """Blockwise: a weight scaled by one scale for the whole tensor, not per B x B block."""
    from plait.model import fp8_blockwise as fb

    blocked = fb.quantize_weight

    def per_tensor(w, block):
        _, inv = blocked(w, block)
        scale = fb.scale_for(fb.widened(w).abs().amax(), fb.E4M3)
        return fb.to_fp8(w, scale, fb.E4M3), (inv * 0 + 1) / scale

    fb.quantize_weight = per_tensor


def block_promotion_ignored():
    """Blockwise: the GEMM dequantizes its operands and sums the whole inner dimension in
    one matmul at the accumulator's precision, never promoting every B."""
    from plait.model import fp8_blockwise as fb

    def unpromoted(a, a_inv, b, b_inv, out_dtype):
        acc = fb.wide_dtype(out_dtype)
        left = (a.to(acc) * a_inv[..., None].to(acc)).flatten(1)
        right = (b.to(acc) * b_inv[:, None].to(acc)).flatten(0, 1)
        return (left @ right).to(out_dtype)

    fb.promoted_mm = unpromoted


def block_scales_not_reduced():
    """ZeRO-3 under blockwise: each rank casts its shard with the amaxes of the block parts
    it holds, the blocks' amaxes never all-reduced."""
    from plait.parallel import zero_fp8_blocks

    class _Local:
        @staticmethod
        def all_reduce(*args, **kwargs):
            return None

    zero_fp8_blocks.comm = _Local


PLAN_FP8 = "tests/test_plan_fp8.py::"
BLOCKWISE = "tests/test_fp8_blockwise.py::"
RECIPE_WRITTEN_OUT = [BLOCKWISE + "test_each_gemm_is_the_recipe_written_out[bf16]",
                      BLOCKWISE + "test_each_gemm_is_the_recipe_written_out[fp64]"]

MUTANTS = [
    Mutant("fp8-amax-not-reduced", "float8 scales from each rank's part of a split tensor",
           amax_not_reduced,
           [FP8_PARITY + "test_fp8_layout_equals_the_single_process_fp8_run"
            "[dp2 z2 cp2:ring fp64]",
            FP8_PARITY + "test_fp8_layout_equals_the_single_process_fp8_run"
            "[dp2 z3 tp2 sp pp2:1f1b fp64]"]),
    Mutant("fp8-gradients-e4m3", "float8 backward casts gradients to E4M3, not E5M2",
           gradients_in_e4m3, [FP8 + "test_float8_linear_is_the_recipe"]),
    Mutant("plan-fp8-gather-two-bytes",
           "plait plan prices ZeRO-3's float8 weight gathers at two bytes an element",
           plan_gathers_fp8_at_two_bytes,
           [FP8 + "test_zero3_gathers_the_block_weights_in_float8",
            PLAN_FP8 + "test_states_are_bf16s_and_zero3_gathers_the_linears_at_one_byte"]),
    Mutant("plan-fp8-bf16-peak", "plait plan prices float8 GEMMs at the bf16 peak",
           plan_fp8_at_the_bf16_peak,
           [PLAN_FP8 + "test_weight_gemms_at_the_float8_peak_the_rest_at_bf16s"]),
    Mutant("fp8-block-activations-per-row",
           "blockwise float8 scales an activation per row, not per 1 x B tile",
           block_activations_per_row, RECIPE_WRITTEN_OUT),
    Mutant("fp8-block-weights-per-tensor",
           "blockwise float8 scales a weight per tensor, not per B x B block",
           block_weights_per_tensor, RECIPE_WRITTEN_OUT),
    Mutant("fp8-block-promotion-ignored",
           "blockwise float8 sums the whole inner dimension without promoting every B",
           block_promotion_ignored, RECIPE_WRITTEN_OUT),
    Mutant("fp8-block-scales-not-reduced",
           "ZeRO-3 casts each shard by its own part of a block's amax",
           block_scales_not_reduced,
           [FP8_PARITY + "test_fp8_layout_equals_the_single_process_fp8_run"
            "[dp2 z3 tp2 sp blockwise fp64]"]),
]
