"""Mutation check (`make mutants`): known bugs injected into plait, each must fail a test.

Each mutant monkeypatches plait in the pytest process (tests/mutant_plugin.py applies it
in `pytest_configure`, before test modules are imported and before run_ranks forks the
ranks, which inherit it). For every mutant a fresh

    python -m pytest <its tests> -p tests.mutant_plugin --mutant NAME -q -x

runs. Exit 1 with assertion failures: CAUGHT. Exit 0: NOT CAUGHT. Exit 2-4 (collection
error, interrupted, internal error, usage) or a failure that is not an assertion (the
patch itself crashed, e.g. a rank raised a TypeError): BROKEN, the mutant proves nothing.
A control run (no mutant) over the union of the selections must pass.

    .venv/bin/python tests/mutants.py                 # all mutants + control
    .venv/bin/python tests/mutants.py --only dp-bucketed-doubled --no-control
    .venv/bin/python tests/mutants.py --list

Not collected by pytest (the name does not start with test_). Exits non-zero when a
mutant is not caught, is broken, or the control fails. Processes a test launches apply
the mutant too (tests/mutant_plugin.py, tests/mutant_site/sitecustomize.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.mutant_kit import Mutant, _Namespace  # noqa: E402

# ---- the patches ----------------------------------------------------------------------------


def dp_bucketed_doubled():
    from plait.parallel.data import DataParallel

    finish = DataParallel.finish

    def doubled(self):
        finish(self)
        if self.mode == "bucketed" and self.mesh.size(self.dim) > 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(2)  # the all-reduced bucket written back twice over

    DataParallel.finish = doubled


def naive_skips_all_reduce():
    from plait.parallel.data import DataParallel

    finish = DataParallel.finish

    def skipped(self):
        if self.mode == "naive":
            return  # each replica keeps its local gradient
        finish(self)

    DataParallel.finish = skipped


def non_causal_attention():
    import torch.nn.functional as F

    from plait.model import layers

    sdpa = F.scaled_dot_product_attention

    def sees_the_future(*args, is_causal=False, **kwargs):
        return sdpa(*args, is_causal=False, **kwargs)

    # the causal core of both attentions (plait/model/layers.py)
    layers.F = _Namespace(F, scaled_dot_product_attention=sees_the_future)


def _patch_rope_tables(fn):
    from plait.model import rope

    rope.rope_tables = fn  # the model's RoPE cache builds its tables with it


def rope_positions_reversed():
    from plait.model import rope

    tables = rope.rope_tables

    def reversed_tables(head_dim, seq_len, theta, scaling=None):
        cos, sin = tables(head_dim, seq_len, theta, scaling)
        return cos.flip(0), sin.flip(0)  # position i rotated as seq_len - 1 - i

    _patch_rope_tables(reversed_tables)


def rope_pairs_by_halves():
    import torch

    from plait.model import rope, transformer

    def halves(x, cos, sin):  # pairs (x[i], x[i + d/2]) instead of (x[2i], x[2i+1])
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h].float(), x[..., h:].float()
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)

    rope.apply_rope = halves
    transformer.apply_rope = halves  # imported by name there: the attention's rotation


def mla_rope_key_unrotated():
    from plait.model import mla

    rotate = mla.apply_rope

    def key_left_alone(x, cos, sin):  # the shared key (one head) skips its rotation
        return x if x.shape[1] == 1 else rotate(x, cos, sin)

    mla.apply_rope = key_left_alone  # imported by name there


def bf16_masters():
    import torch

    from plait import optim  # the maths' own module: adamw_update calls its _adam_chunk

    init, chunk = optim.MixedPrecisionAdamW.__init__, optim._adam_chunk

    def no_fp32_copy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.master = [p.data for p in self.params]  # the bf16 parameter is its own master
        if self.kind == "adamw":
            self.exp_avg = [torch.zeros_like(m) for m in self.master]
            self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]

    def low_precision_chunk(masters, grads, *rest):
        return chunk(masters, [g.to(m.dtype) for g, m in zip(grads, masters)], *rest)

    optim.MixedPrecisionAdamW.__init__ = no_fp32_copy
    optim._adam_chunk = low_precision_chunk  # a no-op cast for fp32 masters (ZeRO's)


def norm_counts_every_replica():
    from plait.placement import PlacementTable

    def always(self, p, mesh, also_sharded=()):
        return True

    # the one rule, read by global_grad_norm and ZeRO's norm alike
    PlacementTable.counts_in_norm = always


def zero_reduce_scatter_average():
    from plait.comm.ops import _DONE
    from plait.parallel.zero import ZeroOptimizer

    complete = ZeroOptimizer._complete_reduce_scatter

    def averaged(self, u):
        u.rs_handle.wait()
        u.rs_out.div_(self.mesh.size(self.dim))  # mean over dp, not the sum
        u.rs_handle = _DONE
        complete(self, u)

    ZeroOptimizer._complete_reduce_scatter = averaged


def loss_over_local_tokens():
    from plait.model import loss
    from plait.parallel.pipeline import partition

    token_loss = loss.token_loss

    def local(logits, targets, tokens_in_global_batch, loss_fn=None):
        return token_loss(logits, targets, targets.numel(), loss_fn)  # micro-batch mean

    loss.token_loss = local  # microbatch_loss's too: it reads its module's global
    partition.token_loss = local  # imported by name: the stages' loss


def clip_ignored():
    from plait.train import loop

    loop.clip_coefficient = lambda total_norm, max_norm: 1.0


def clip_halved():
    from plait.train import loop

    coefficient = loop.clip_coefficient
    loop.clip_coefficient = lambda total_norm, max_norm: coefficient(total_norm, max_norm) / 2


def cp_grads_over_dp_only():
    from plait.parallel.replicated import ReplicatedOptimizer

    init = ReplicatedOptimizer.__init__

    def dp_only(self, model, mesh, cfg, placements, dim="dp"):
        init(self, model, mesh, cfg, placements, "dp")  # cp ranks' shares never summed

    ReplicatedOptimizer.__init__ = dp_only


def cp_future_blocks_seen():
    from plait.parallel.context import Ring

    def every_block(self, src, split=None):  # no key chunk skipped: queries see the future
        mine, theirs = self.chunks(self.me), self.chunks(src)
        return [(i, j, kq == qq) for i, qq in enumerate(mine) for j, kq in enumerate(theirs)]

    Ring.pairs = every_block


def ckpt_moments_dropped():
    from plait.checkpoint import reader

    read = reader.read_pieces

    def without_second_moment(path, meta, wanted, files=None):
        read(path, meta, [p for p in wanted if p.state != "exp_avg_sq"], files)

    reader.read_pieces = without_second_moment  # resumed Adam starts with v = 0


def ckpt_tp_offset_lost():
    from plait.checkpoint import pieces

    box = pieces.tp_box

    def at_zero(name, pl, local_shape, mesh):
        got = box(name, pl, local_shape, mesh)
        return None if got is None else ((0,) * len(got[0]), got[1])

    pieces.tp_box = at_zero  # every tp slice written and read as the first one


def dcp_slice_offset_lost():
    from plait.checkpoint import dcp

    planner = dcp._box_planner

    def at_zero():
        cls = planner()

        class AtZero(cls):
            def __init__(self, offsets, requests):
                super().__init__({n: (0,) * len(o) for n, o in offsets.items()}, requests)

        return AtZero

    dcp._box_planner = at_zero  # every rank's rectangle read from the tensor's corner


def dcp_flat_run_misaligned():
    from plait.checkpoint import dcp

    cut = dcp.cut
    dcp.cut = lambda block, p, skip: cut(block, p, 0)  # a ZeRO run from its first row's start


def plan_stages_even():
    from plait.plan import basis

    basis.stage_layers = lambda layers, pp, even, stack: (even, even, even)  # knobs ignored


def plan_elementwise_backward_proxy():
    from plait.plan import compute

    # the backward's element-wise kernels priced as twice the forward's, not by their bytes
    compute.LayerTimes.backward_elementwise = property(lambda self: 2 * self.elementwise_fwd)


DP = "tests/test_data_parallel.py::"
TP = "tests/test_tensor_parallel.py::"
CP = "tests/test_context_parallel.py::"
ZERO = "tests/test_zero.py::"
MODEL = "tests/test_model.py"
CKPT = "tests/test_checkpoint.py::"

MUTANTS = [
    Mutant("plan-elementwise-backward-proxy",
           "plait plan prices the backward's memory-bound kernels as twice the forward's",
           plan_elementwise_backward_proxy,
           ["tests/test_plan_memory_bound.py::"
            "test_published_step_carries_the_memory_bound_term_and_fitted_does_not"]),
    Mutant("plan-stages-even", "plait plan ignores --first/--last-stage-layers",
           plan_stages_even,
           ["tests/test_plan_published.py::test_llama3_405b_8k_layout_fits_with_its_uneven_stages"]),
    Mutant("dp-bucketed-doubled", "bucketed DP all-reduce result doubled (sum written twice)",
           dp_bucketed_doubled,
           [DP + "test_parity_with_accumulation_and_clipping[bucketed-2]",
            DP + "test_sgd_with_clipping_parity[dp2]"]),
    Mutant("non-causal-attention", "attention sees the future (is_causal=False)",
           non_causal_attention, [MODEL], k="causal"),
    Mutant("naive-skips-all-reduce", "naive DP never all-reduces its gradients",
           naive_skips_all_reduce,
           [DP + "test_parity_with_accumulation_and_clipping[naive-2]",
            DP + "test_sgd_with_clipping_parity[dp4-naive]"]),
    Mutant("rope-positions-reversed", "RoPE tables indexed by reversed position",
           rope_positions_reversed, [MODEL], k="rope"),
    Mutant("rope-pairs-by-halves", "RoPE pairs (x[i], x[i+d/2]) instead of adjacent pairs",
           rope_pairs_by_halves, [MODEL], k="rope"),
    Mutant("mla-rope-key-unrotated", "MLA's shared RoPE key is never rotated",
           mla_rope_key_unrotated, ["tests/test_mla.py"], k="formula"),
    Mutant("bf16-masters", "no fp32 master: AdamW updates bf16 weights, bf16 moments",
           bf16_masters, [DP + "test_bf16_close_to_fp32_reference"]),
    Mutant("norm-counts-every-replica", "grad norm counts a replicated parameter on every rank",
           norm_counts_every_replica,
           [TP + "test_parity[False]", TP + "test_parity_dp_x_tp_with_zero[1]"]),
    Mutant("zero-rs-average", "ZeRO reduce-scatter averages over dp instead of summing",
           zero_reduce_scatter_average,
           [DP + "test_sgd_with_clipping_parity[dp2-zero2]",  # dp=2, ZeRO-2
            ZERO + "test_parity_with_accumulation_and_clipping[3]"]),
    Mutant("loss-local-tokens", "micro-batch loss / its own tokens, not the global batch's",
           loss_over_local_tokens,
           [DP + "test_single_rank_plait_equals_reference",
            DP + "test_parity_with_accumulation_and_clipping[bucketed-2]"]),
    Mutant("clip-ignored", "clipping coefficient ignored (always 1)", clip_ignored,
           [DP + "test_single_rank_plait_equals_reference",
            DP + "test_parity_with_accumulation_and_clipping[bucketed-2]"]),
    Mutant("clip-halved", "clipping coefficient half what it should be", clip_halved,
           [DP + "test_sgd_with_clipping_parity[dp2-tp2-sp]"]),
    Mutant("cp-grads-over-dp-only", "context parallel: gradients summed over dp, not dp x cp",
           cp_grads_over_dp_only,
           [CP + "test_parity[cp=2]", CP + "test_parity[dp=2,cp=2,zero=1,microbatches=2]"]),
    Mutant("cp-future-blocks-seen", "ring attention computes key chunks after the query's",
           cp_future_blocks_seen, [CP + "test_core_equals_full_causal_attention[2]",
                                   CP + "test_parity[cp=2]"]),
    Mutant("ckpt-moments-dropped", "a resume loads no Adam second moment",
           ckpt_moments_dropped, [CKPT + "test_resume_same_layout_is_bit_identical[single]"]),
    Mutant("ckpt-tp-offset-lost", "checkpoint tp slices placed at offset 0",
           ckpt_tp_offset_lost,
           [CKPT + "test_reshard_continues_within_parity_of_the_reference[parallel.tp=2->"
            "single]"]),
    Mutant("dcp-slice-offset-lost", "a DCP read places every rank's slice at offset 0",
           dcp_slice_offset_lost,
           ["tests/test_dcp.py::test_fsdp2_checkpoint_read_by_plait_in_another_layout"]),
    Mutant("dcp-flat-run-misaligned", "a ZeRO flat run cut from the wrong place of its "
           "DCP rows", dcp_flat_run_misaligned,
           ["tests/test_dcp.py::test_fsdp2_checkpoint_read_by_plait_in_another_layout"]),
]

from tests.mutants_fp8 import MUTANTS as FP8_MUTANTS  # noqa: E402
from tests.mutants_oracle import MUTANTS as ORACLE_MUTANTS  # noqa: E402
from tests.mutants_parallel import MUTANTS as PARALLEL_MUTANTS  # noqa: E402
from tests.mutants_pipeline import MUTANTS as PIPELINE_MUTANTS  # noqa: E402
from tests.mutants_plan_gpu import MUTANTS as PLAN_GPU_MUTANTS  # noqa: E402

MUTANTS += (PIPELINE_MUTANTS + PARALLEL_MUTANTS + FP8_MUTANTS + PLAN_GPU_MUTANTS
            + ORACLE_MUTANTS)


# ---- the runner ---------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    bug: str
    status: str  # CAUGHT, NOT CAUGHT, BROKEN (mutants); PASS, FAIL (control)
    failed: list[str]
    seconds: float
    detail: str = ""
    # the largest parity error over its bound among the comparisons the run made (None:
    # no parity comparison ran): how far outside the bounds a mutant that parity catches is
    margin: float | None = None


def parity_margin(record: Path) -> float | None:
    """The largest error / bound over every parity comparison in a record of
    tests/parity_record_plugin.py (inf where a zero bound is broken)."""
    from plait.testing import PARITY_TOLERANCES

    if not record.exists():
        return None
    worst = None
    for line in record.read_text().splitlines():
        rec = json.loads(line)
        bounds = PARITY_TOLERANCES[rec["precision"]]
        for key, (err, _) in rec["errors"].items():
            ratio = err / bounds[key] if bounds[key] else (float("inf") if err else 0.0)
            worst = ratio if worst is None else max(worst, ratio)
    return worst


def _failures(junit: Path) -> tuple[list[str], list[str]]:
    """(node ids of failed tests, their failure messages' first lines) from a junit xml."""
    if not junit.exists():
        return [], []
    ids, messages = [], []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for tag in ("failure", "error"):
            bad = case.find(tag)
            if bad is None:
                continue
            path = case.get("classname", "").replace(".", "/") + ".py"
            ids.append(f"{path}::{case.get('name')}" + (" (error)" if tag == "error" else ""))
            messages.append((bad.get("message") or "").splitlines()[0] if bad.get("message")
                            else "")
    return ids, messages


def _is_assertion(message: str) -> bool:
    # a RankFailure is an AssertionError subclass, but it means a rank raised: for the
    # tests selected here (asserting in the parent) that is the patch crashing
    return message.startswith(("AssertionError", "assert ")) and "RankFailure" not in message


def run_pytest(mutant: str, tests: list[str], k: str | None, timeout: float) -> tuple[
        int, list[str], list[str], float, str, float | None]:
    with tempfile.TemporaryDirectory() as tmp:
        junit, record = Path(tmp) / "junit.xml", Path(tmp) / "parity.jsonl"
        cmd = [sys.executable, "-m", "pytest", *tests, "-p", "tests.mutant_plugin",
               "--mutant", mutant, "-q", "-rf", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-p", "tests.parity_record_plugin",
               "--parity-record", str(record)]
        if mutant != "none":
            cmd.append("-x")
        if k:
            cmd += ["-k", k]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = -1, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
        seconds = time.perf_counter() - start
        ids, messages = _failures(junit)
        margin = parity_margin(record)
    return rc, ids, messages, seconds, out, margin


def run_mutant(m: Mutant, timeout: float) -> Outcome:
    rc, ids, messages, seconds, out, margin = run_pytest(m.name, m.tests, m.k, timeout)
    if rc == 0:
        return Outcome(m.name, m.bug, "NOT CAUGHT", [], seconds, margin=margin)
    if rc == 1 and ids and all(_is_assertion(msg) for msg in messages):
        return Outcome(m.name, m.bug, "CAUGHT", ids, seconds, messages[0][:160], margin)
    tail = "\n".join(out.strip().splitlines()[-15:])
    return Outcome(m.name, m.bug, "BROKEN", ids, seconds,
                   f"pytest exit {rc}; " + (messages[0][:200] if messages else tail))


def selection(mutants: list[Mutant]) -> list[str]:
    """The control's tests: the union of the mutants' selections (a -k applies to a file
    only, so a file with a -k contributes the node ids it selects)."""
    tests: list[str] = []
    for m in mutants:
        if m.k is None:
            tests += [t for t in m.tests if t not in tests]
            continue
        ids = subprocess.run([sys.executable, "-m", "pytest", *m.tests, "-k", m.k,
                              "--collect-only", "-q", "-o", "addopts=", "-p",
                              "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
        tests += [t for t in ids.splitlines() if "::" in t and t not in tests]
    return tests


def print_table(rows: list[Outcome]) -> None:
    w = max(len(r.name) for r in rows)
    wb = max(len(r.bug) for r in rows)
    print(f"\n{'mutant':<{w}}  {'bug it models':<{wb}}  {'result':<10}  {'time':>6}  "
          f"{'parity err/bound':>16}  failed tests")
    print("-" * (w + wb + 58))
    for r in rows:
        failed = ", ".join(f.removeprefix("tests/") for f in r.failed) or "-"
        margin = "-" if r.margin is None else f"{r.margin:.3g}"
        print(f"{r.name:<{w}}  {r.bug:<{wb}}  {r.status:<10}  {r.seconds:5.0f}s  "
              f"{margin:>16}  {failed}")
    print()
    for r in rows:  # the first failure's message: what the catching test saw
        if r.detail:
            print(f"{r.name}: {r.detail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[],
                    help="run only these mutants (repeat or comma-separate)")
    ap.add_argument("--no-control", action="store_true", help="skip the unmutated control run")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    args = ap.parse_args(argv)

    chosen = MUTANTS
    if args.only:
        names = {n for arg in args.only for n in arg.split(",") if n}
        unknown = names - {m.name for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutants {sorted(unknown)}; known: {[m.name for m in MUTANTS]}")
        chosen = [m for m in MUTANTS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.bug}\n    " + " ".join(m.tests)
                  + (f" -k {m.k!r}" if m.k else ""))
        return 0

    total = time.perf_counter()
    rows: list[Outcome] = []
    for m in chosen:
        print(f"mutant {m.name} ...", flush=True)
        rows.append(run_mutant(m, args.timeout))
        print(f"  {rows[-1].status} in {rows[-1].seconds:.0f} s", flush=True)
    if not args.no_control:
        tests = selection(chosen)
        print(f"control (no mutant): {len(tests)} tests ...", flush=True)
        rc, ids, _, seconds, out, margin = run_pytest("none", tests, None, args.timeout * 2)
        status = "PASS" if rc == 0 else "FAIL"
        detail = "" if rc == 0 else "\n".join(out.strip().splitlines()[-15:])
        rows.append(Outcome("control", f"no mutant, the same {len(tests)} tests", status, ids,
                            seconds, detail, margin))
    print_table(rows)
    by_parity = [r for r in rows if r.status == "CAUGHT" and r.margin is not None and r.margin > 1]
    if by_parity:
        least = min(by_parity, key=lambda r: r.margin)
        control = [r.margin for r in rows if r.name == "control" and r.margin is not None]
        print(f"\n{len(by_parity)} mutants caught by a parity bound; the least is "
              f"{least.margin:.3g}x its bound ({least.name})"
              + (f"; the control's worst is {control[0]:.3g}x" if control else ""))
    print(f"\ntotal {time.perf_counter() - total:.0f} s")
    bad = [r.name for r in rows if r.status not in ("CAUGHT", "PASS")]
    if bad:
        print(f"FAILED: {', '.join(bad)}")
        return 1
    print("every mutant caught" + ("" if args.no_control else "; control passes"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
