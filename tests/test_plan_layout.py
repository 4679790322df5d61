"""The planner's `Layout`: sizes by dimension record, and the quantities its formulas read."""

from __future__ import annotations

import dataclasses

import pytest

from plait.dims import DIMENSIONS, REPLICA_AXES
from plait.plan.basis import WRITTEN, Layout


def test_sizes_are_the_records_one_where_not_given():
    lay = Layout(tp=2, dp=4)
    assert lay.sizes == {d.name: {"tp": 2, "dp": 4}.get(d.name, 1) for d in DIMENSIONS}
    assert (lay.tp, lay.dp, lay.pp) == (2, 4, 1)  # each record's size by its name
    assert Layout({"tp": 2, "dp": 4}).sizes == lay.sizes
    with pytest.raises(TypeError, match="no dimension xp"):
        Layout(xp=2)


def test_what_the_sizes_mean():
    lay = Layout(tp=2, pp=2, dp=4, cp=2, ep=4)
    assert lay.world == 2 * 2 * 4 * 2  # the axes; ep is laid over the replicas
    assert lay.replicas == 4 * 2 and set(REPLICA_AXES) == {"dp", "cp"}
    assert (lay.seq_split, lay.expert_split) == (2, 4)
    assert lay.laid() == {"ep": 4, "dp_replicate": 1}


def test_label_and_written_order():
    assert WRITTEN == ("tp", "pp", "dp", "cp", "ep", "dp_replicate")
    assert Layout(tp=8, pp=2, dp=4).label() == "tp=8,pp=2,dp=4"
    assert Layout(tp=8, dp=4, ep=2).label() == "tp=8,pp=1,dp=4,ep=2"
    assert Layout(tp=2, dp=2, order=("dp", "tp", "cp", "pp")).label() == \
        "tp=2,pp=1,dp=2 order dp,tp,cp,pp"


def test_replace_keeps_the_sizes():
    lay = Layout(tp=2, dp=4, cp=2)
    other = dataclasses.replace(lay, order=("dp", "tp", "cp", "pp"))
    assert other.sizes == lay.sizes and other.order == ("dp", "tp", "cp", "pp")
    assert Layout(**{**lay.__dict__, "sp": False}).sizes == lay.sizes
