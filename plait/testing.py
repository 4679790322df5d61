"""The parity oracle's side of the tests: the tolerances (one place, docs/parity.md), the
merge of a run's ranks into one result, and the comparison with the reference.

The fork harness that runs a function on N ranks is production code (`plait calibrate`
uses it): `plait.launch.forked.run_ranks`.
"""

from __future__ import annotations

from typing import Any

import torch

# ---- the parity oracle's tolerances: the one place they live ----------------------------
# Each bound is at most 3x the worst error measured over every comparison of its class in
# the suite (`python tests/measure_tolerances.py` re-measures them and rewrites the table in
# docs/parity.md, which states each bound's worst error and where it was seen;
# tests/test_parity_tolerances.py holds these numbers to that table). What each class
# covers, and why its errors are what they are, is docs/parity.md's "Tolerances".
PARITY_TOLERANCES = {
    # fp32, sums reordered across replicas, micro-batches and pipeline stages only. MoE:
    # identical routing, so the balancing biases are equal exactly.
    "fp32": {"loss_rtol": 5.4e-7, "norm_rtol": 7.6e-6, "grad_rtol": 2.7e-6,
             "param_atol": 8e-5, "aux_rtol": 2e-7, "bias_atol": 0.0},
    # fp32 tensor parallel: sums reordered inside every layer too (row-parallel partial
    # products, the vocab-parallel softmax)
    "fp32-tp": {"loss_rtol": 5.8e-7, "norm_rtol": 5.4e-6, "grad_rtol": 3.8e-6,
                "param_atol": 8e-5, "aux_rtol": 1.1e-7, "bias_atol": 0.0},
    # fp32 context parallel: attention's softmax merged block by block (ring) or over a
    # permuted key order (all-gather), dK/dV summed over its ranks
    "fp32-context": {"loss_rtol": 6.5e-7, "norm_rtol": 4.3e-6, "grad_rtol": 3.8e-6,
                     "param_atol": 8e-5, "aux_rtol": 1.4e-7, "bias_atol": 0.0},
    # fp32 tensor or context parallel with grouped KV heads: a KV head's gradient summed
    # over the query heads of several ranks; Adam's g/sqrt(v) turns a rounding difference
    # in a rarely seen token's embedding row into up to ~lr of movement
    "fp32-gqa": {"loss_rtol": 5.4e-7, "norm_rtol": 3.5e-6, "grad_rtol": 3.1e-6,
                 "param_atol": 2.1e-4},
    # bf16 compute, fp32 masters and moments: element-wise parameter bounds mean nothing
    # (Adam turns a sign flip of a tiny bf16 gradient into +-lr a step), so each tensor's
    # error is held against the reference's own movement from the initial weights. The
    # movement bound is 2x the worst measured, below what dropping the fp32 masters gives
    # (1.07 at dp=2 over 4 steps).
    "bf16": {"loss_rtol": 4.1e-4, "norm_rtol": 1.8e-2, "grad_rtol": 5.6e-2,
             "param_move_rtol": 0.75},
    # bf16 with MoE: a token whose top-k margin is below bf16's resolution takes another
    # expert set than in the fp32 reference, moving its whole contribution between experts:
    # the gradients are compared by each tensor's relative L2 error, not element-wise, and
    # a balancing bias may differ by a few sign steps
    "bf16-moe": {"loss_rtol": 1.6e-4, "norm_rtol": 1.5e-2, "grad_l2_rtol": 0.21,
                 "param_move_rtol": 0.8, "aux_rtol": 1.6e-3, "bias_atol": 5.9e-2},
    # float8 layouts against the single-process float8 run: a bf16 sum reordered moves a
    # value across a float8 rounding boundary (E5M2 steps are 25 %), and that difference
    # travels through every layer's backward: bf16's kind of bounds, looser (movement: 2x)
    "fp8": {"loss_rtol": 3.3e-4, "norm_rtol": 3.2e-2, "grad_rtol": 3.6e-1,
            "param_move_rtol": 8.1e-1},
    # the same float8 GEMMs in an fp32 model (tests/test_fp8_parity.py): sums reorder at
    # fp32's ulp, a float8 rounding rarely flips, and a scale that is not the whole
    # tensor's (an amax not reduced over the ranks splitting it) is caught
    "fp8-fp32": {"loss_rtol": 3.9e-7, "norm_rtol": 7.7e-3, "grad_rtol": 5.2e-3,
                 "param_move_rtol": 5.3e-2},
}

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


def parity_errors(run: dict, ref: Any, precision: str = "fp32",
                  init: dict[str, torch.Tensor] | None = None) -> dict[str, tuple[float, str]]:
    """A run's largest error against the reference on every check `assert_parity` makes,
    each with where it was seen: {tolerance key: (error, where)}.

    loss_rtol, norm_rtol: relative, over every step of every rank in `run["ranks"]` (or
    the run's own `losses` and `grad_norms`); grad_rtol: each first-step gradient tensor's
    largest element difference over its own largest element; grad_l2_rtol: each tensor's
    ||g - g_ref|| / ||g_ref||; param_atol: the largest absolute parameter difference;
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
        key = "param_atol" if "param_atol" in tol else "param_move_rtol"
        out[key] = _worst(_param_errors(run["params"], ref.params, key, init))
    return out


def assert_parity(run: dict, ref: Any, precision: str = "fp32",
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
        diff = grads[name].float() - g.float()
        if kind == "max":
            errs.append((float(diff.abs().max()) / (float(g.abs().max()) or 1.0), name))
        else:
            errs.append((float(diff.norm()) / (float(g.float().norm()) or 1.0), name))
    return errs


def _param_errors(params: dict, ref: dict, key: str, init: dict | None
                  ) -> list[tuple[float, str]]:
    assert set(params) == set(ref), set(params) ^ set(ref)
    errs = []
    for name, r in ref.items():
        p, r = params[name].float(), r.float()
        if key == "param_atol":
            errs.append((float((p - r).abs().max()), name))
            continue
        # relative to how far the reference itself moved this tensor
        assert init is not None, "bf16 parity needs the initial weights (init=...)"
        moved = float((r - init[name].float()).norm())
        errs.append((float((p - r).norm()) / moved, name))
    return errs
