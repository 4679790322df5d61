"""The parity oracle's side of the tests: the tolerances (one place, docs/parity.md), the
merge of a run's ranks into one result, and the comparison with the reference.

The fork harness that runs a function on N ranks is production code (`plait calibrate`
uses it): `plait.launch.forked.run_ranks`.
"""

from __future__ import annotations

from typing import Any

import torch

# ---- the parity oracle's tolerances: the one place they live ----------------------------
# Exactness is proven in float64: a layout changes only the order of floating-point sums,
# and a reordered float64 sum differs by a few units of float64's epsilon (2.2e-16) times
# the summands' magnitude (Higham 2002, "Accuracy and Stability of Numerical Algorithms",
# section 4.2). The bounds below are that epsilon times a stated growth factor, the same on
# every CPU; none is fitted to what one machine's kernels happened to give. A small fp32 set
# is held the same way to fp32's epsilon. Only bf16 and float8 over bf16, whose roundings
# the kernels' order really changes, have measured bounds: the worst over the CPU kernel
# paths (ATEN_CPU_CAPABILITY default, avx2, avx512), docs/parity.md.
EPS64 = float(torch.finfo(torch.float64).eps)  # 2.2e-16
EPS32 = float(torch.finfo(torch.float32).eps)  # 1.2e-7

# The checks a derived bound covers, each held to epsilon x the class's growth factor:
# - float64, 2^22 (~1e-9): a reordered sum's error grows with its length and the
#   condition of what follows it; 4 million ulps is far above any layout's worst scalar or
#   gradient (2^6 ulps), and still far below the least any mutant does (docs/parity.md);
# - fp32, 2^10: the worst-case error n x eps of one reordered sum of n = 1024 terms
#   (Higham, eq. 3.4), longer than any single reduction of the test models; its set runs
#   plain SGD, whose update is linear in the gradient, so the parameter bound means
#   something (AdamW's sign steps would not: docs/parity.md).
# Parameters are compared relative to the peak learning rate (param_lr_rtol), with
# PARAM_GROWTH more room: AdamW's update is lr x m/(sqrt(v)+eps), so a gradient element
# near eps moves its weight by lr times that gradient's own relative error, the largest
# amplification of a rounding in the run (float64's worst: 2^19.5 ulps, a rarely seen
# token's embedding row under GQA).
DERIVED_CHECKS = ("loss_rtol", "norm_rtol", "grad_rtol", "param_lr_rtol", "aux_rtol")
PARAM_GROWTH = 4


def _derived(eps: float, growth: int, moe: bool = True) -> dict[str, float]:
    out = {k: growth * eps * (PARAM_GROWTH if k == "param_lr_rtol" else 1)
           for k in DERIVED_CHECKS if moe or k != "aux_rtol"}
    # MoE routing is identical, so the balancing biases are equal exactly
    return {**out, "bias_atol": 0.0} if moe else out


PARITY_TOLERANCES = {
    # every layout in float64 against the float64 single-process run. MoE: identical
    # routing, so the balancing biases are equal exactly.
    "fp64": _derived(EPS64, 2 ** 22),
    # float8 GEMMs in a float64 model (train.fp8_compute=fp64) against the one-process run
    # of the same recipe: equal inputs quantise equally, and each float8 GEMM accumulates
    # its exact products in float64, so the float64 bounds hold
    "fp8-fp64": _derived(EPS64, 2 ** 22, moe=False),  # MoE rows: no aux or bias checks
    # the fp32 set (tests/test_fp32_parity.py): fp32's epsilon, with AdamW off (plain SGD,
    # whose update is linear in the gradient) so that the parameter bound means something
    "fp32": _derived(EPS32, 2 ** 10, moe=False),
    # bf16 compute, fp32 masters and moments: element-wise parameter bounds mean nothing
    # (Adam turns a sign flip of a tiny bf16 gradient into +-lr a step), so each tensor's
    # error is held against the reference's own movement from the initial weights. The
    # movement bound is below what dropping the fp32 masters gives (1.07 at dp=2 over 4
    # steps).
    "bf16": {"loss_rtol": 4.1e-4, "norm_rtol": 1.8e-2, "grad_rtol": 5.6e-2,
             "param_move_rtol": 0.75},
    # bf16 with MoE: a token whose top-k margin is below bf16's resolution takes another
    # expert set than in the fp32 reference, moving its whole contribution between experts:
    # the gradients are compared by each tensor's relative L2 error, not element-wise, and
    # a balancing bias may differ by a few sign steps
    "bf16-moe": {"loss_rtol": 1.6e-4, "norm_rtol": 1.5e-2, "grad_l2_rtol": 0.21,
                 "param_move_rtol": 0.8, "aux_rtol": 1.5e-3, "bias_atol": 5.9e-2},
    # float8 layouts in bf16 (the run users make) against the single-process float8 run: a
    # bf16 sum reordered moves a value across a float8 rounding boundary (E5M2 steps are
    # 25 %), and that difference travels through every layer's backward: bf16's kind of
    # bounds, looser
    "fp8": {"loss_rtol": 3.3e-4, "norm_rtol": 3.2e-2, "grad_rtol": 3.6e-1,
            "param_move_rtol": 8.1e-1},
}
# the classes whose bounds are epsilon x growth (the others are measured over kernel
# paths): (epsilon, growth)
DERIVED_CLASSES = {"fp64": (EPS64, 2 ** 22), "fp8-fp64": (EPS64, 2 ** 22),
                   "fp32": (EPS32, 2 ** 10)}

# float8 against bf16, one process, the tiny model over 100 steps: the largest relative
# loss difference at any step (benchmarks/fp8_loss.py; docs/parity.md, "Float8")
FP8_LOSS_RTOL = 1.5e-2


def loss_gap(losses: list[float], baseline: list[float]) -> tuple[float, int, float]:
    """(largest relative difference, its step, mean relative difference over the last ten
    steps) of one loss curve against another of the same length."""
    assert len(losses) == len(baseline), (len(losses), len(baseline))
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, baseline, strict=True)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    tail = rel[-10:]
    return rel[worst], worst, sum(tail) / len(tail)


def merge_ranks(outs: list[dict]) -> dict:
    """One replica's (or one job's) run as one result: the union of its ranks' parameters
    and first gradients (pipeline stages; tp ranks hold the same gathered tensors, which must
    agree exactly) and MoE balancing biases, and every rank's losses, grad norms and MoE
    auxiliary losses (`ranks`), each of which `assert_parity` compares with the reference."""
    merged = {"losses": outs[0]["losses"], "grad_norms": outs[0]["grad_norms"],
              "ranks": [{k: o[k] for k in ("losses", "grad_norms", "aux_losses") if k in o}
                        for o in outs]}
    for key in ("params", "first_grads", "biases"):
        if all(o.get(key) is None for o in outs):
            continue
        union: dict[str, torch.Tensor] = {}
        for o in outs:
            for name, t in o[key].items():
                if name in union:
                    assert torch.equal(union[name], t), f"{key} {name} differs across ranks"
                union[name] = t
        merged[key] = union
    return merged


def _worst(errors: list[tuple[float, str]]) -> tuple[float, str]:
    return max(errors, key=lambda e: e[0]) if errors else (0.0, "-")


def parity_errors(run: dict, ref: Any, precision: str = "fp64",
                  init: dict[str, torch.Tensor] | None = None) -> dict[str, tuple[float, str]]:
    """A run's largest error against the reference on every check `assert_parity` makes,
    each with where it was seen: {tolerance key: (error, where)}.

    loss_rtol, norm_rtol: relative, over every step of every rank in `run["ranks"]` (or
    the run's own `losses` and `grad_norms`); grad_rtol: each first-step gradient tensor's
    largest element difference over its own largest element; grad_l2_rtol: each tensor's
    ||g - g_ref|| / ||g_ref||; param_lr_rtol: the largest parameter difference over the
    peak learning rate (`ref.lr`);
    param_move_rtol: ||p - p_ref|| / ||p_ref - p_init|| of the worst tensor; with MoE,
    aux_rtol: the balance loss of every step of every rank (`aux_losses`), relative, and
    bias_atol: the largest difference of a balancing bias after the last step (`biases`)."""
    tol = PARITY_TOLERANCES[precision]
    ranks = run.get("ranks") or [run]
    out: dict[str, tuple[float, str]] = {}
    for key, field in (("loss_rtol", "losses"), ("norm_rtol", "grad_norms")):
        expected = ref.losses if field == "losses" else ref.grad_norms
        errs = []
        for r, got in enumerate(ranks):
            assert len(got[field]) == len(expected), (field, r, len(got[field]), len(expected))
            errs += [(abs(a - b) / abs(b), f"rank {r} step {step}")
                     for step, (a, b) in enumerate(zip(got[field], expected, strict=True))]
        out[key] = _worst(errs)
    if any("aux_losses" in r for r in ranks):  # MoE: the balance loss of every step
        expected = [m["aux_loss"] for m in ref.moe]
        out["aux_rtol"] = _worst([(abs(a - b) / abs(b), f"rank {r} step {step}")
                                  for r, got in enumerate(ranks)
                                  for step, (a, b) in enumerate(zip(got["aux_losses"], expected,
                                                                    strict=True))])
    if run.get("biases") is not None:  # MoE: the balancing bias after the last step
        expected = ref.moe[-1]["bias"]
        assert set(run["biases"]) == set(expected), set(run["biases"]) ^ set(expected)
        out["bias_atol"] = _worst([(float((run["biases"][n] - b).abs().max()), n)
                                   for n, b in expected.items()])
    grads = run.get("first_grads")
    if grads is not None and tol.get("grad_rtol") is not None:
        out["grad_rtol"] = _worst(_grad_errors(grads, ref.first_grads, "max"))
    if grads is not None and tol.get("grad_l2_rtol") is not None:
        out["grad_l2_rtol"] = _worst(_grad_errors(grads, ref.first_grads, "l2"))
    if run.get("params") is not None:
        key = "param_lr_rtol" if "param_lr_rtol" in tol else "param_move_rtol"
        out[key] = _worst(_param_errors(run["params"], ref, key, init))
    return out


def assert_parity(run: dict, ref: Any, precision: str = "fp64",
                  init: dict[str, torch.Tensor] | None = None) -> None:
    """A run (`losses`, `grad_norms`, and where it has them `ranks`, `params`,
    `first_grads`) against the reference (plait.train.reference.Reference), within the
    stated tolerances: loss and grad norm (before clipping) at every step of every rank,
    each first-step gradient tensor, every final parameter. bf16 needs `init` (the initial
    weights) for its movement bound."""
    tol = PARITY_TOLERANCES[precision]
    for key, (err, where) in parity_errors(run, ref, precision, init).items():
        assert err <= tol[key], (f"{precision}: {where}: {key.removesuffix('_rtol')} error "
                                 f"{err:.3e} > {tol[key]:.1e} (steps {len(ref.losses)})")


def _grad_errors(grads: dict, ref: dict, kind: str) -> list[tuple[float, str]]:
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    errs = []
    for name, g in ref.items():
        g = g.double()
        diff = grads[name].double() - g
        if kind == "max":
            errs.append((float(diff.abs().max()) / (float(g.abs().max()) or 1.0), name))
        else:
            errs.append((float(diff.norm()) / (float(g.norm()) or 1.0), name))
    return errs


def _param_errors(params: dict, ref: Any, key: str, init: dict | None
                  ) -> list[tuple[float, str]]:
    assert set(params) == set(ref.params), set(params) ^ set(ref.params)
    errs = []
    for name, r in ref.params.items():
        p, r = params[name].double(), r.double()  # compared in float64, whatever was run
        if key == "param_lr_rtol":
            assert ref.lr > 0, "the reference's peak learning rate (ref.lr) is needed"
            errs.append((float((p - r).abs().max()) / ref.lr, name))
            continue
        # relative to how far the reference itself moved this tensor
        assert init is not None, "bf16 parity needs the initial weights (init=...)"
        moved = float((r - init[name].double()).norm())
        errs.append((float((p - r).norm()) / moved, name))
    return errs
