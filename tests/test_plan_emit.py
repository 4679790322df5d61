"""`plait plan --emit-config`: the planned layout as a config plait train accepts, trained,
and `plait report --plan` on the run against the same plan."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
from helpers import batches_for, token_file
from helpers import plan_cli as plan

from plait.config import load_config
from plait.launch.forked import run_ranks

TINY = ("--model", "tiny", "--vocab", "256", "--seq", "32", "--global-batch", "8")




@pytest.mark.parametrize("gpus,layout,extra,want", [
    ("2", "dp=2", ("--zero", "3"), {"dp": 2, "zero": 3}),
    ("2", "tp=2", ("--zero", "0", "--async-tp"), {"tp": 2, "sp": True, "async_tp": True}),
    ("2", "pp=2", ("--schedule", "gpipe", "--zero", "0", "--microbatch", "2"),
     {"pp": 2, "schedule": "gpipe", "microbatches": 4}),
    ("4", "pp=2,dp=2", ("--schedule", "interleaved", "--virtual-stages", "2", "--zero", "1",
                        "--model", "small"), {"virtual_stages": 2, "zero": 1}),
    ("2", "pp=2", ("--schedule", "dualpipev", "--zero", "0", "--overlap-fb", "--model",
                   "small"), {"schedule": "dualpipev", "overlap_fb": True}),
    ("2", "cp=2", ("--recompute", "full"), {"cp": 2}),
    ("2", "tp=2", ("--recompute", "selective", "--zero", "0"), {"tp": 2}),
    ("4", "dp=4,dp_replicate=2", ("--zero", "2"), {"dp": 4, "dp_replicate": 2, "zero": 2}),
])
def test_emitted_config_loads_and_validates(tmp_path, gpus, layout, extra, want):
    path = tmp_path / "run.toml"
    rc, out = plan(*TINY, "--gpus", gpus, "--layout", layout, *extra, "--emit-config", str(path))
    assert rc == 0, out
    cfg = load_config(path)
    assert cfg.validate(int(gpus)) == []
    assert cfg.parallel.world_size == int(gpus)
    got = {**vars(cfg.parallel), **{k: getattr(cfg.train, k) for k in ("recompute",)}}
    assert {k: got[k] for k in want} == want
    # one meaning of each mode in plan and train (selective with flash: the runtime's list)
    asked = dict(zip(extra[::2], extra[1::2])).get("--recompute", "none")
    assert cfg.train.recompute == asked
    side = json.loads((tmp_path / "run.plan.json").read_text())
    assert side["layout"]["layout"][layout.split("=")[0]] == int(layout.split("=")[1][0])
    assert tomllib.loads(path.read_text())["parallel"]["dp"] == cfg.parallel.dp


def test_search_emits_a_large_layout_that_validates(tmp_path):
    path = tmp_path / "big.toml"
    rc, out = plan("--model", "llama3-70b", "--gpus", "1024", "--global-batch", "1024",
                   "--top", "3", "--emit-config", str(path), "--json")
    assert rc == 0, out
    cfg = load_config(path)
    assert cfg.model_name == "llama3-70b" and cfg.validate(1024) == []
    assert any("written to" in line for line in json.loads(out)["explanation"])


def test_unrunnable_layout_refused_and_nothing_written(tmp_path):
    path = tmp_path / "run.toml"
    rc, out = plan(*TINY, "--arch", "gpt", "--gpus", "2", "--layout", "dp=2", "--emit-config",
                   str(path))
    assert rc == 2 and "builds the llama block only" in out
    rc, out = plan(*TINY, "--attention", "math", "--gpus", "2", "--layout", "dp=2",
                   "--emit-config", str(path))
    assert rc == 2 and "runtime attention is SDPA" in out
    assert list(tmp_path.iterdir()) == []


def _train_emitted(rank: int, world: int, path: str):
    from plait.mesh import ParallelMesh
    from plait.train.loop import train

    cfg = load_config(path, sets=["train.steps=1"]).check(world)
    result = train(cfg, ParallelMesh.build(cfg.parallel), batches_for(cfg))
    return result.losses


def test_emitted_layout_trains_one_step_in_process(tmp_path):
    path = tmp_path / "run.toml"
    rc, out = plan(*TINY, "--gpus", "2", "--layout", "tp=2", "--precision", "fp32",
                   "--emit-config", str(path))
    assert rc == 0, out
    token_file()  # made in the parent, before the ranks fork
    losses = run_ranks(_train_emitted, 2, str(path))
    assert len(losses[0]) == 1 and losses[0] == losses[1]


@pytest.mark.slow  # torchrun
def test_plait_train_runs_it_and_report_compares_with_the_plan(tmp_path, capsys):
    """`plait train --config` (torchrun, 2 ranks) on the emitted file, then `plait report
    --plan` in process (plait.cli.main, as a shell would call it)."""
    from plait.cli.main import main

    cfg_path, metrics = tmp_path / "run.toml", tmp_path / "m.jsonl"
    rc, out = plan(*TINY, "--gpus", "2", "--layout", "dp=2", "--zero", "1",
                   "--emit-config", str(cfg_path))
    assert rc == 0, out
    r = subprocess.run([sys.executable, "-m", "plait.cli", "train", "--config", str(cfg_path),
                        "--nproc", "2", "--data", str(token_file()), "--steps", "2",
                        "--metrics-out", str(metrics), "--quiet"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    capsys.readouterr()
    assert main(["report", "--metrics", str(metrics), "--plan",
                 str(tmp_path / "run.plan.json"), "--json"]) == 0
    pc = json.loads(capsys.readouterr().out)["plan"]
    assert pc["mismatches"] == [] and pc["hardware"] == "h100-sxm"
    assert pc["step_time"]["measured_s"] > 0 and pc["step_time"]["predicted_s"] > 0
    (dp,) = [d for d in pc["communication"] if d["dim"] == "dp"]
    assert dp["planned_bytes"] > 0 and dp["measured_bytes"] > 0
    # another layout's plan beside this run: named as not the planned layout
    other = tmp_path / "other.toml"
    assert plan(*TINY, "--gpus", "2", "--layout", "tp=2", "--emit-config", str(other))[0] == 0
    assert main(["report", "--metrics", str(metrics), "--plan",
                 str(tmp_path / "other.plan.json")]) == 0
    assert "not the planned layout: tp: planned 2, run 1" in capsys.readouterr().out
