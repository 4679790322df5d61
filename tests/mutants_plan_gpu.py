"""Injected bugs in what the published GPU numbers price beyond the kernels' FLOPs and
bytes (plait/plan/zero3_gpu.py, plait/plan/overlap_slowdown.py), each caught by its tests."""

from __future__ import annotations

from dataclasses import replace

from tests.mutant_kit import Mutant

GPU_COSTS = "tests/test_plan_gpu_costs.py::"


def plan_zero3_copy_out_once():
    """ZeRO-3's copy-out reads the gathered buffer but writes nothing."""
    from plait.plan import zero3_gpu

    original = zero3_gpu.copy_bytes

    def read_only(train, params, gathered, gathered_bytes, n, rounds):
        return original(train, params, gathered, gathered_bytes, n, rounds) \
            - gathered_bytes * (n > 1)
    zero3_gpu.copy_bytes = read_only


def plan_overlap_slows_the_whole_collective():
    """Compute is slowed for each collective's whole time, its exposed part included."""
    from plait.plan import overlap_slowdown

    overlap_slowdown.hidden_seconds = lambda colls: sum(
        c.total for c in colls if c.dim not in overlap_slowdown.NOT_BESIDE)


def plan_rails_one_nic():
    """A node-spanning group crosses on one NIC, however many of its ranks a node holds."""
    import numpy as np

    from plait.plan.comm import price

    price.rails = lambda n, span, gpus_per_node, nics_per_node=0: np.ones_like(
        np.asarray(n, dtype=float) * np.asarray(span, dtype=float))


def plan_attention_backward_at_forward_rate():
    """Fused attention's backward priced at the forward's measured rate."""
    from plait.plan import gpu_data

    original = gpu_data.attention_kernel

    def forward_only(fam, kernel="auto"):
        name, k = original(fam, kernel)
        return name, ({**k, "backward": k["forward"]} if "forward" in k else k)
    gpu_data.attention_kernel = forward_only


def plan_math_attention_no_roofline():
    """The math kernel's attention GEMMs move no bytes (the GEMM curve alone)."""
    from plait.plan import compute

    compute.math_attention_bytes = lambda shape, tokens, tp: 0.0 * tokens


def plan_eager_bytes_as_fused():
    """An eager stack's operators move a fused kernel's bytes."""
    from plait.plan import memory_bound

    memory_bound.Kernel.bytes = lambda self, fused: (self.fwd_bytes, self.bwd_bytes)


def plan_training_rate_skips_attention():
    """The training rate left off the fused attention sweep."""
    from plait.plan import gpu_data

    original = gpu_data.published

    def attention_isolated(gpu, attention="auto", rate=None):
        pub = original(gpu, attention, rate)
        if pub is None:
            return None
        iso = original(gpu, attention, 1.0)
        eff = replace(pub.eff, attention_curve=iso.eff.attention_curve)
        return replace(pub, eff=eff)
    gpu_data.published = attention_isolated


def plan_range_times_error():
    """The step-time range multiplies the prediction by (1 + error): a run predicted 20 %
    too fast read as one that ran faster still."""
    from plait.plan import error_band

    error_band.Band.measured_range = lambda self, predicted: (
        predicted * (1 + min(self.errors)), predicted * (1 + max(self.errors)))


def plan_range_any_stack():
    """The step-time range takes the runs of every kernel stack alike."""
    from plait.plan import error_band

    original = error_band.band_of

    def any_stack(family, n_gpus, stack="fused", runs=None):
        runs = error_band.load()["runs"] if runs is None else runs
        return original(family, n_gpus, stack, [{**r, "stack": stack} for r in runs])
    error_band.band_of = any_stack


def plan_untested_terms_silent():
    """Every layout term counts as tested: the flag never prints."""
    from plait.plan import error_band

    error_band.untested_lines = lambda terms, runs=None: []


BAND = "tests/test_plan_error_band.py::"
MUTANTS = [
    Mutant("plan-zero3-copy-out-once",
           "plait plan counts ZeRO-3's copy-out as a read only (half its bytes)",
           plan_zero3_copy_out_once,
           [GPU_COSTS + "test_zero3_copy_bytes_count_each_kernel"]),
    Mutant("plan-overlap-whole-collective",
           "plait plan slows compute beside a collective's exposed seconds too",
           plan_overlap_slows_the_whole_collective,
           [GPU_COSTS + "test_compute_beside_hidden_collectives_runs_slower"]),
    Mutant("plan-rails-one-nic",
           "plait plan sends a node-spanning ring over one NIC whatever its ranks a node",
           plan_rails_one_nic,
           [GPU_COSTS + "test_a_node_spanning_group_crosses_on_its_ranks_nics"]),
    Mutant("plan-attention-backward-at-forward-rate",
           "plait plan prices fused attention's backward at the forward's rate",
           plan_attention_backward_at_forward_rate,
           [GPU_COSTS + "test_fused_attention_prices_forward_and_backward_at_their_rates"]),
    Mutant("plan-math-attention-no-roofline",
           "plait plan runs the math kernel's attention GEMMs on the GEMM curve alone",
           plan_math_attention_no_roofline,
           [GPU_COSTS + "test_math_attention_gemms_meet_the_hbm_roofline"]),
    Mutant("plan-eager-bytes-as-fused",
           "plait plan counts an eager stack's operators as one fused kernel's bytes",
           plan_eager_bytes_as_fused,
           ["tests/test_plan_memory_bound.py::test_eager_launches_bound_a_small_pass_only"]),
    Mutant("plan-training-rate-skips-attention",
           "plait plan runs fused attention at its isolated rate in a training step",
           plan_training_rate_skips_attention,
           ["tests/test_plan_published.py::"
            "test_training_rate_scales_every_kernel_rate_and_nothing_else"]),
    Mutant("plan-range-times-error",
           "plait plan's step-time range multiplies the prediction by (1 + error)",
           plan_range_times_error,
           [BAND + "test_band_takes_the_runs_of_the_same_stack_and_scale"]),
    Mutant("plan-range-any-stack",
           "plait plan's step-time range takes the runs of every kernel stack alike",
           plan_range_any_stack,
           [BAND + "test_band_falls_back_where_a_class_has_one_run"]),
    Mutant("plan-untested-terms-silent",
           "plait plan flags no layout term the scored runs never used",
           plan_untested_terms_silent,
           [BAND + "test_plan_prints_the_range_on_the_published_numbers_only"]),
]
