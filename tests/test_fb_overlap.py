"""The overlapped F&B executor (plait/parallel/pipeline/fb_overlap.py, `--overlap-fb`): the
baton's order on fake transfers, its refusals, and on 4 ranks the expert all-to-alls of a
pair's forward and backward issued interleaved (parity: tests/matrix.py's `ofb` rows)."""

from __future__ import annotations

import pytest
import torch
from helpers import config, shared_run
from matrix import parse
from torch import nn

from plait.comm.autograd import OverlapSeam
from plait.parallel.pipeline.fb_overlap import FBPair
from plait.schedule.ir import paired_share
from plait.schedule.registry import build_schedule


class _Handle:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


class _Dispatch:
    def __init__(self):
        self.seam = OverlapSeam()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.dispatch = _Dispatch()


def _pair() -> tuple[FBPair, OverlapSeam]:
    block = _Block()
    return FBPair([block], torch.device("cpu")), block.dispatch.seam


def test_the_sides_take_turns_at_each_all_to_all():
    pair, seam = _pair()
    log: list[str] = []

    def forward():
        log.append("F attention")
        seam.wait(_Handle("dispatch", log), False)
        log.append("F experts")
        seam.wait(_Handle("combine", log), False)
        log.append("F rest")
        return "f"

    def backward():
        log.append("B combine grad")
        seam.wait(_Handle("combine.grad", log), True)
        log.append("B experts grad")
        return "b"

    assert pair.run(forward, backward) == ("f", "b")
    # each transfer is waited for after the other side's piece ran under it
    assert log == ["F attention", "B combine grad", "wait dispatch", "F experts",
                   "wait combine.grad", "B experts grad", "wait combine", "F rest"]
    assert seam.wait is None  # outside a pair, all-to-alls complete at once


def test_an_error_on_the_backward_side_is_raised_after_both_end():
    pair, seam = _pair()
    ran: list[str] = []

    def forward():
        seam.wait(_Handle("dispatch", ran), False)
        ran.append("F done")

    def backward():
        raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        pair.run(forward, backward)
    assert ran == ["wait dispatch", "F done"] and seam.wait is None


@pytest.mark.parametrize("sets,fix", [
    (("parallel.pp=2", "parallel.schedule=1f1b"), "use --schedule dualpipev or dualpipe"),
    (("parallel.tp=2",), "use --tp 1"),
    (("parallel.zero=3",), "use --zero 0 or 1"),
    (("train.recompute=full",), "use --recompute none"),
    (("parallel.optimizer_sync=post_validation",), "use optimizer_sync=barrier"),
])
def test_unbuilt_combinations_are_refused_naming_the_fix(sets, fix):
    base = ("parallel.pp=2", "parallel.schedule=dualpipev", "parallel.overlap_fb=true")
    problems = config(*base, *sets).validate()
    assert any("--overlap-fb" in p and fix in p for p in problems), problems
    assert not [p for p in config(*base).validate() if "--overlap-fb" in p]


def _switches(outs: list[dict]) -> int:
    """On rank 0, its last step: how often the token all-to-alls turn between a
    forward's and a backward's (`.grad`) in issue order."""
    ledger = outs[0]["ledger"]
    last = max(r["step"] for r in ledger)
    kinds = [r["tag"].endswith(".grad") for r in ledger
             if r["step"] == last and r["dim"] == "ep" and r["op"] == "all_to_all"
             and not r["tag"].endswith(".counts")]
    return sum(a != b for a, b in zip(kinds, kinds[1:]))


def test_a_pairs_all_to_alls_are_issued_interleaved():
    row = "dp2 z1 pp2:dualpipev moe ep2"
    plain = shared_run(*parse(row)["sets"], "train.steps=2")
    overlapped = shared_run(*parse(row + " ofb")["sets"], "train.steps=2")
    # rank 0's steady phase: 3 pairs of forward and backward, each MoE layer's dispatch
    # and combine: sequential runs turn once into and out of each backward
    assert _switches(overlapped) >= _switches(plain) + 6
    assert overlapped[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-12)
    # every all-to-all a pair issued was waited for (its record timed at completion)
    for out in overlapped:
        waits = [r for r in out["ledger"] if r["dim"] == "ep" and r["op"] == "all_to_all"]
        assert waits and all(r["end"] > r["start"] for r in waits)


def _ep_all_to_all(*sets: str):
    from plait.plan.from_config import estimate_config

    est = estimate_config(config(*parse("dp2 z1 pp2:dualpipev moe ep2")["sets"], *sets))
    (a2a,) = [c for c in est.collectives if c.dim == "ep" and c.op == "all-to-all"]
    return a2a


def test_the_planner_credits_the_overlap_only_where_the_runtime_runs_it():
    off = _ep_all_to_all()
    on = _ep_all_to_all("parallel.overlap_fb=true")
    assert off.exposed == pytest.approx(off.count * off.time_each, rel=1e-12)
    assert off.overlap.startswith("none")
    assert on.exposed < off.exposed and "DualPipe" in on.overlap
    # only the chunks the runtime pairs hide theirs: dualpipev at pp=2, m=4 pairs 3 of
    # rank 0's 8 forwards
    share = paired_share(build_schedule("dualpipev", 2, 4, 2))
    assert share == 3 / 8 and on.exposed >= (1 - share) * off.exposed * (1 - 1e-12)
    assert (on.size, on.count) == (off.size, off.count)  # the same bytes either way


@pytest.mark.slow  # two plan searches of DeepSeek-V3 at 2048 GPUs (seconds each)
def test_deepseek_plans_dualpipe_only_when_its_overlap_runs():
    from helpers import plan_cli

    argv = ("--model", "deepseek-v3", "--gpus", "2048", "--gpu", "h800")
    rc_on, on = plan_cli(*argv, "--overlap-fb")
    rc_off, off = plan_cli(*argv)  # its runner-up has a term the best has not: explained
    best = [next(ln for ln in out.splitlines() if ln.startswith("Best:")) for out in (on, off)]
    assert (rc_on, rc_off) == (0, 0)
    assert "schedule dualpipev" in best[0] and "dualpipe" not in best[1], best
