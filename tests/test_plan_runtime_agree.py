"""`plait plan` and `plait train` agree on which layouts exist.

For a grid of layouts of one model on 8 ranks (every factorisation tp x pp x dp x cp with
cp <= 2, every schedule, ZeRO 0-3, every recompute mode, micro-batches of 1 and 2): the
planner's `layout_problems` is empty exactly when the runtime's `validate` is. Both read
the schedule registry's rules; the
planner's search asks every rule a build does (`plait.plan.schedule_facts.planner_rules`).
Convention: the planner's `sp` means sequence parallel wherever tp > 1 (the runtime's
`parallel.sp` is refused at tp = 1), and plan evaluates the model's own shape.
"""

import dataclasses
import itertools

import pytest
from helpers import config

from plait.plan.estimate import Layout, Training
from plait.plan.from_config import PLACEHOLDER_GPU
from plait.plan.hardware import Cluster
from plait.plan.search import layout_problems, search
from plait.plan.shape import from_model_config
from plait.schedule.registry import SCHEDULE_NAMES, natural_virtual_stages

WORLD = 8
BASE = config("model.n_layers=8", "train.seq_len=64", "train.global_batch=16")


def _layouts():
    for tp, pp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2)):
        if WORLD % (tp * pp * cp):
            continue
        dp = WORLD // (tp * pp * cp)
        for schedule, zero, rec, mbs in itertools.product(
                SCHEDULE_NAMES, range(4), ("none", "selective", "full"), (1, 2)):
            if pp == 1 and schedule != "1f1b":
                continue  # without a pipeline the schedule is not read
            yield tp, pp, dp, cp, schedule, zero, rec, mbs


def _runtime_problems(tp, pp, dp, cp, schedule, zero, rec, mbs):
    p = dataclasses.replace(BASE.parallel, tp=tp, pp=pp, dp=dp, cp=cp, sp=tp > 1, zero=zero,
                            schedule=schedule, microbatches=None)
    t = dataclasses.replace(BASE.train, micro_batch_size=mbs, recompute=rec)
    return dataclasses.replace(BASE, parallel=p, train=t).validate(WORLD)


def _plan_problems(tp, pp, dp, cp, schedule, zero, rec, mbs):
    shape = from_model_config(BASE.model, BASE.train.seq_len)
    lay = Layout(tp=tp, pp=pp, dp=dp, cp=cp, mbs=mbs, schedule=schedule,
                 v=natural_virtual_stages(schedule, None), zero=zero, recompute=rec, sp=True)
    return layout_problems(shape, Cluster(PLACEHOLDER_GPU, WORLD),
                           Training(BASE.train.global_batch), lay)


def test_plan_valid_equals_runtime_valid():
    disagree, n_valid, n = [], 0, 0
    for lay in _layouts():
        run, plan = _runtime_problems(*lay), _plan_problems(*lay)
        n += 1
        n_valid += not run
        if bool(run) != bool(plan):
            disagree.append((lay, run, plan))
    assert not disagree, f"{len(disagree)} of {n} disagree, e.g. {disagree[:3]}"
    assert 0 < n_valid < n  # the grid has both kinds
    # the combinations the runtime refuses are among them, refused by both
    for refused in [(1, 4, 2, 1, "dualpipev", 0, "none", 2)]:  # dualpipev: m=4 < 2p-1
        assert _runtime_problems(*refused) and _plan_problems(*refused), refused
    # recomputation with a split backward, ZeRO-2/3 with pipelines and ZeRO with DualPipe's
    # two copies are built: valid in both
    for built in [(1, 2, 4, 1, "zb-v", 1, "selective", 1), (1, 2, 4, 1, "1f1b", 2, "none", 1),
                  (1, 2, 4, 1, "zb-h1", 3, "full", 1), (1, 2, 4, 1, "dualpipe", 3, "full", 1)]:
        assert not _runtime_problems(*built) and not _plan_problems(*built), built


@pytest.mark.parametrize("gpus", [64])
def test_search_offers_only_runnable_combinations(gpus):
    """Every layout the search scores passes `layout_problems` (so the runtime's rules):
    no DualPipeV with m < 2p - 1; ZeRO-2/3 with pp and ZeRO with DualPipe are searched."""
    from plait.plan.calibration import EFFICIENCY
    from plait.plan.hardware import get_gpu
    from plait.plan.shape import from_preset

    shape, cluster, train = from_preset("llama3-8b", 4096), Cluster(get_gpu("h100-sxm"), gpus), \
        Training(256)
    result = search(shape, cluster, train, EFFICIENCY, top=20)
    assert result.top
    for est in result.top:
        assert layout_problems(shape, cluster, train, est.layout) == [], est.layout
    lay = Layout(tp=8, pp=2, dp=4, mbs=1, schedule="dualpipe", zero=3)
    assert layout_problems(shape, cluster, train, lay) == []
