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


MUTANTS = [
    Mutant("fp8-amax-not-reduced", "float8 scales from each rank's part of a split tensor",
           amax_not_reduced,
           [FP8_PARITY + "test_fp8_layout_equals_the_single_process_fp8_run"
            "[dp2 z2 cp2:ring fp32]",
            FP8_PARITY + "test_fp8_layout_equals_the_single_process_fp8_run"
            "[dp2 z3 tp2 sp pp2:1f1b fp32]"]),
    Mutant("fp8-gradients-e4m3", "float8 backward casts gradients to E4M3, not E5M2",
           gradients_in_e4m3, [FP8 + "test_float8_linear_is_the_recipe"]),
]
