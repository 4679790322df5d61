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


PLAN_FP8 = "tests/test_plan_fp8.py::"

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
]
