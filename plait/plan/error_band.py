"""A plan's step time as a range: the leave-one-source-out error that
benchmarks/plan_gpu_error.py measured on published runs like this one (the same GPU
family, kernel stack, fused or eager, and scale, one node or several), read from
plait/plan/data/step_time_error.json, which that script writes (`--write-bands`).

A run's held-out error e = (predicted - measured) / measured was measured with the
training rate fitted without the run's source, so predicted / (1 + e) is what such a run
measured for that prediction: the range is the prediction divided by (1 + the largest
error) to (1 + the smallest). Where no published run of the GPU family was scored, or the
plan is beyond the largest GPU count scored, the line says so, as it names each term of
the layout no scored run used (a dimension split, a pipeline schedule, a ZeRO stage, a
recompute mode, routed experts): the prediction rests on terms the data never tested.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from plait.dims import AXES, LAID

DATA_FILE = "step_time_error.json"
# a scale class needs this many scored runs to stand on its own (else the family's runs)
MIN_RUNS = 2
NODE_GPUS = 8  # one node of the GPU presets (8 GPUs a node)


@lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    """The data file, read from the package."""
    text = resources.files("plait.plan").joinpath("data", DATA_FILE).read_text("utf-8")
    return json.loads(text)


def scale_of(n_gpus: int) -> str:
    """The scale class of a run: one node, or several."""
    return "one node" if n_gpus <= NODE_GPUS else "several nodes"


def stack_of(fused_kernels: bool) -> str:
    """The kernel stack class of a run (Stack.fused_kernels): the step's kernels fused (a
    compiled or Transformer Engine stack) or eager (one kernel an operator)."""
    return "fused" if fused_kernels else "eager"


@dataclass(frozen=True)
class Band:
    """The held-out errors of the scored runs like a plan's."""

    family: str
    # the runs taken, in words: their stack and scale classes, or "every ..." where the
    # runs of that class were too few
    like: str
    errors: tuple[float, ...]  # (predicted - measured) / measured, one a run
    largest_gpus: int  # the most GPUs of a scored run of the family

    def measured_range(self, predicted: float) -> tuple[float, float]:
        """(fastest, slowest) step time the scored runs measured for such a prediction."""
        return predicted / (1 + max(self.errors)), predicted / (1 + min(self.errors))

    @property
    def mean_abs(self) -> float:
        return sum(map(abs, self.errors)) / len(self.errors)


def band_of(family: str | None, n_gpus: int, stack: str = "fused",
            runs: list[dict[str, Any]] | None = None) -> Band | None:
    """The band of the scored `runs` (default: the data file's) of GPU family `family`
    with kernel stack `stack` (stack_of's class) at `n_gpus`' scale; where those are under
    MIN_RUNS, the family's runs of that stack at every scale, then of every stack at that
    scale, then all of them. None where no run of the family was scored."""
    runs = load()["runs"] if runs is None else runs
    same = [r for r in runs if r["family"] == family]
    if not same:
        return None
    scale = scale_of(n_gpus)
    tries = [(f"{stack} stack, {scale}", lambda r: r["stack"] == stack
              and scale_of(r["gpus"]) == scale),
             (f"{stack} stack, every scale", lambda r: r["stack"] == stack),
             (f"every stack, {scale}", lambda r: scale_of(r["gpus"]) == scale)]
    like, words = same, "every stack and scale"
    for label, keep in tries:
        chosen = [r for r in same if keep(r)]
        if len(chosen) >= MIN_RUNS:
            like, words = chosen, label
            break
    return Band(family or "", words, tuple(r["error"] for r in like),
                max(r["gpus"] for r in same))


def range_lines(predicted: float, family: str | None, n_gpus: int, stack: str = "fused",
                runs: list[dict[str, Any]] | None = None) -> list[str]:
    """The plan's step time with the range runs like it measured, and a flag where the
    data never tested its GPU family or its scale."""
    band = band_of(family, n_gpus, stack, runs)
    src = load()["source"]
    if band is None:
        return [f"UNTESTED: step time {predicted:.3f} s with no measured error: no published "
                f"run on a {(family or 'this GPU').upper()} was scored ({src})."]
    lo, hi = band.measured_range(predicted)
    lines = [f"Step time {predicted:.3f} s; runs like this one measured {lo:.3f}-{hi:.3f} s "
             f"for such a prediction: leave-one-source-out errors {100 * min(band.errors):+.1f} "
             f"% to {100 * max(band.errors):+.1f} % (mean |error| {100 * band.mean_abs:.1f} %) "
             f"over the {len(band.errors)} published {band.family.upper()} runs like it "
             f"({band.like}; {src})."]
    if n_gpus > band.largest_gpus:
        lines.append(f"UNTESTED SCALE: {n_gpus:,} GPUs, beyond the largest scored "
                     f"{band.family.upper()} run ({band.largest_gpus:,}): collectives at "
                     "this scale rest on terms the data never tested.")
    return lines


def terms_of(sizes: dict[str, Any], schedule: str, zero: int, recompute: str, moe: bool
             ) -> list[str]:
    """The terms a layout's step time rests on, in words: each dimension it splits, its
    pipeline schedule (when pipelined), its ZeRO stage and recompute mode, routed experts."""
    dims = AXES + LAID
    split = [d for d in dims if d.splits != "batch" and float(sizes.get(d.name, 1)) > 1]
    piped = any(d.splits == "layers" for d in split)
    return ([d.title for d in split] + ([f"the {schedule} schedule"] if piped else [])
            + [f"ZeRO-{zero}", f"recompute {recompute}"] + (["routed experts"] if moe else []))


def untested_lines(terms: list[str], runs: list[dict[str, Any]] | None = None) -> list[str]:
    """A flag naming the `terms` (terms_of's) no scored run used, on any GPU (a schedule's
    or a ZeRO stage's price is the same model on every GPU)."""
    runs = load()["runs"] if runs is None else runs
    seen = {t for r in runs for t in r["terms"]}
    new = [t for t in terms if t not in seen]
    if not new:
        return []
    return [f"UNTESTED TERMS: no scored run used {', '.join(new)}; the step time prices "
            f"{'it' if len(new) == 1 else 'them'} unchecked against a measured run."]
