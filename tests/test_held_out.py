"""Validation during training (`plait train --eval-every N --eval-data FILE`,
plait/train/held_out.py): the held-out loss of every layout equals the single-process
run's in float64 and an independent computation from the reference's weights; evaluating
changes nothing of the training; the forward-only schedule of every pipeline schedule
runs its forwards exactly; bad input is refused before anything starts."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import BASE, SESSION_ROOT, batches_for, config, reference, token_file
from sink_readers import tensorboard_scalars, wandb_offline_run

from plait.cli.main import main
from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.model.transformer import build_model
from plait.observe.html import _run_section
from plait.schedule.lower import forward_only, lower
from plait.schedule.registry import (
    SCHEDULE_NAMES,
    build_schedule,
    natural_virtual_stages,
)
from plait.testing import PARITY_TOLERANCES
from plait.train.data import TokenFile, synthetic_token_file
from plait.train.held_out import held_out_count
from plait.train.loop import TrainOptions, train
from plait.train.progress import progress_reporter
from plait.train.sinks import MetricSinks

EVAL = ("train.eval_every=2",)  # 4 steps: the loss after steps 1 and 3
DENSE = ("model.n_layers=4", "model.tie_embeddings=false")
LAYOUTS = {
    "dp2-zero3": ("parallel.dp=2", "parallel.zero=3"),
    "tp2-sp": ("parallel.tp=2", "parallel.sp=true"),
    "pp2": ("parallel.pp=2", "parallel.microbatches=4"),
    "pp2-zbv": ("parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=zb-v"),
    "pp2-dualpipe": ("parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=dualpipe"),
    "pp2-post-validation": ("parallel.pp=2", "parallel.microbatches=4",
                            "parallel.optimizer_sync=post_validation"),
    "dp2-zero1": ("parallel.dp=2", "parallel.zero=1"),
    "dp2-zero3-step": ("parallel.dp=2", "parallel.zero=3", "parallel.zero3_gather=step"),
    "cp2": ("parallel.cp=2",),
    "dp2-ep2-moe": ("parallel.dp=2", "parallel.ep=2", "model.n_experts=4", "model.top_k=2",
                    "model.expert_ffn_dim=32"),
}


@cache
def held_out_file() -> Path:
    """3 global batches of held-out windows (another seed than the training file's)."""
    path = SESSION_ROOT / "held-out-256.bin"
    if not path.exists():
        synthetic_token_file(path, 24 * 32 + 1, 256, seed=11)
    return path


def _rank(rank: int, world: int, sets: list[str], evaluate: bool) -> dict:
    evaluation = (*EVAL, f"train.eval_data={held_out_file()}") if evaluate else ()
    cfg = config(*DENSE, *sets, *evaluation).check(world)
    mesh = ParallelMesh.build(cfg.parallel)
    held = TokenFile.open(held_out_file()) if evaluate else None
    result = train(cfg, mesh, batches_for(cfg), TrainOptions(held_out=held, timeline=True))
    return {"metrics": result.metrics, "summary": result.summary,
            "step_bytes": sum(r.sent for r in mesh.ledger.for_step()),
            "timeline_units": [[u[:3] for u in r["units"]] for r in result.timeline["ranks"]]}


@cache
def run(layout: str, evaluate: bool = True) -> list[dict]:
    sets = list(LAYOUTS.get(layout, ()))
    world = config(*DENSE, *sets).parallel.world_size
    token_file(), held_out_file()  # made in the parent, before the ranks fork
    return run_ranks(_rank, world, sets, evaluate)


def val_losses(out: dict) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in out["metrics"] if "val_loss" in m}


def test_single_process_val_loss_is_the_reference_weights_loss():
    """An independent computation: the reference's final weights, the plain model, the
    mean cross-entropy over the held-out file's first whole global batches."""
    out = run("single")[0]
    assert sorted(val_losses(out)) == [1, 3]  # every 2 steps; the last is one of them
    cfg = config(*DENSE)
    model = build_model(cfg.model, seed=cfg.train.seed, dtype=torch.float64)
    model.load_state_dict(reference(*DENSE).params)
    data = TokenFile.open(held_out_file())
    n, s = held_out_count(cfg, data), cfg.train.seq_len
    assert n == 24
    rows = torch.stack([torch.from_numpy(data.tokens[w * s: w * s + s + 1].astype("int64"))
                        for w in range(n)])
    with torch.no_grad():
        logits = model(rows[:, :-1])
    want = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)))
    rtol = PARITY_TOLERANCES["fp64"]["loss_rtol"]
    assert val_losses(out)[3] == pytest.approx(want, rel=rtol, abs=0)
    assert out["summary"]["val_loss"] == val_losses(out)[3]
    assert out["summary"]["val_perplexity"] == pytest.approx(torch.tensor(want).exp().item())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_val_loss_equals_the_single_process_run(layout):
    want = val_losses(run("single")[0]) if "moe" not in layout else None
    outs = run(layout)
    if want is None:  # the MoE model's own single-process run
        want = val_losses(run_ranks(_rank, 1, [s for s in LAYOUTS[layout]
                                               if s.startswith("model.")], True)[0])
    rtol = PARITY_TOLERANCES["fp64"]["loss_rtol"]
    for out in outs:  # every rank reports the same validation
        got = val_losses(out)
        assert sorted(got) == sorted(want)
        for step, loss in want.items():
            assert got[step] == pytest.approx(loss, rel=rtol, abs=0), (layout, step)


@pytest.mark.parametrize("layout", ["dp2-zero3", "dp2-zero3-step", "pp2", "pp2-post-validation",
                                    "dp2-zero1"])
def test_evaluating_changes_nothing_of_the_training(layout):
    """Forward only, outside the step: the losses, grad norms and the step's bytes are
    those of the run without evaluation, exactly. Post-validation checks an evaluated
    step's update at once (the evaluation reads settled weights), not at the next step's
    cut: that check's bytes move to the evaluated step."""
    with_eval, without = run(layout)[0], run(layout, evaluate=False)[0]
    same = ("loss", "grad_norm") + (() if "post" in layout else ("comm_sent_bytes",))
    for key in same:
        assert [m[key] for m in with_eval["metrics"]] == [m[key] for m in without["metrics"]]
    if "post" not in layout:
        assert with_eval["step_bytes"] == without["step_bytes"]
    # the last step's timeline: its own forwards and backwards, not the evaluation's
    assert with_eval["timeline_units"] == without["timeline_units"]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_forward_only_schedule_keeps_each_ranks_forwards_in_order(name):
    full = lower(build_schedule(name, pp=2, microbatches=4,
                                virtual_stages=natural_virtual_stages(name, None)))
    fwd = forward_only(full)
    for acts, kept in zip(full.actions, fwd.actions, strict=True):
        assert kept == [a for a in acts if a.kind in ("F", "SEND_F", "RECV_F")]
        assert kept and all(a.kind not in ("B", "I", "W") for a in kept)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.err + out.out


BASE_ARGS = ["train", "--set", "model.vocab_size=256", "--seq-len", "32",
             "--global-batch", "8", "--steps", "2"]


@pytest.mark.parametrize("extra, phrase", [
    (["--eval-every", "0", "--eval-data", "{held}"], "--eval-every 0: evaluate every N >= 1"),
    (["--eval-every", "-2", "--eval-data", "{held}"], "--eval-every -2"),
    (["--eval-every", "2"], "add --eval-data FILE.bin"),
    (["--eval-data", "{held}"], "read only with --eval-every N"),
    (["--eval-every", "2", "--eval-data", "{tmp}/none.bin"], "--eval-data: token file"),
    (["--eval-every", "2", "--eval-data", "{short}"], "fewer than one global batch of 8"),
    (["--log-every", "0"], "--log-every 0: print a step line every N >= 1 steps"),
    (["--eval-every", "2", "--eval-data", "{short}", "--trace", "{tmp}/short.json"],
     "short.json is also an input of this command"),
    (["--dry-run", "--eval-every", "2", "--eval-data", "{held}"],
     "--dry-run runs one rank in this process and saves nothing; leave out --eval-every"),
])
def test_bad_evaluation_and_log_flags_are_refused_before_anything(extra, phrase, tmp_path,
                                                                   capsys):
    short = synthetic_token_file(tmp_path / "short.bin", 7 * 32 + 1, 256, seed=3)
    names = {"held": held_out_file(), "tmp": tmp_path, "short": short}
    out = tmp_path / "m.jsonl"
    argv = [*BASE_ARGS, "--data", str(token_file()), "--metrics-out", str(out),
            *(a.format(**names) for a in extra)]
    code, text = _cli(argv, capsys)
    assert code == 2 and phrase in text, text
    assert not out.exists() and not Path(f"{out}.partial").exists()


def test_a_non_positive_steps_is_one_problem_naming_steps():
    for steps in (0, -3):
        problems = config(f"train.steps={steps}").validate()
        assert len(problems) == 1 and "--steps" in problems[0], problems
        assert not any("memory_step" in p for p in problems)
    # a memory step past a valid run is still named
    assert any("memory_step=5" in p for p in config("train.steps=3",
                                                    "train.memory_step=5").validate())


def test_plait_report_shows_the_validation_losses(tmp_path, capsys):
    out = run("single")[0]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [*out["metrics"], out["summary"]]))
    code, text = _cli(["report", "--metrics", str(metrics)], capsys)
    assert code == 0, text
    shown = val_losses(out)
    assert "validation loss (held out, --eval-data) after step: " in text
    for step, loss in shown.items():
        assert f"{step} {loss:.4f} (perplexity" in text
    code, text = _cli(["report", "--metrics", str(metrics), "--json"], capsys)
    assert [v["val_loss"] for v in json.loads(text)["validation"]] == list(shown.values())
    assert f"{shown[3]:.4f}" in _run_section(out["metrics"], out["summary"], None)


@pytest.mark.slow  # W&B starts a service process
def test_the_sinks_carry_the_validation_losses(tmp_path):
    """TensorBoard and the offline W&B run, read back: the rows' val_loss at their steps
    and the summary's last one, equal to the JSON's."""
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    out = run("single")[0]
    sinks = MetricSinks(str(tmp_path / "tb"), "held-out", str(tmp_path / "wb"), "offline")
    for row in out["metrics"]:
        sinks.write_row(row)
    sinks.write_summary(out["summary"])
    sinks.close()
    wandb.teardown()  # its service process, which a rank's exit would end
    want = val_losses(out)
    assert tensorboard_scalars(tmp_path / "tb")["val_loss"] == want
    assert tensorboard_scalars(tmp_path / "tb")["summary/val_loss"] == {3: want[3]}
    wb = wandb_offline_run(tmp_path / "wb")
    assert {k: r["val_loss"] for k, r in wb["history"].items() if "val_loss" in r} == want
    assert wb["summary"]["summary/val_perplexity"] == out["summary"]["val_perplexity"]


def test_step_lines_follow_log_every_and_each_validation(capsys):
    rows = [{"step": k, "loss": 1.0, "grad_norm": 0.5, "tokens": 8, "step_time": 0.1,
             "lr": 1e-3} for k in range(7)]
    rows[4].update(val_loss=2.0, val_perplexity=7.389)
    with progress_reporter(7, enabled=True, every=3) as show:
        for row in rows:
            show(row)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert [int(line.split()[1]) for line in lines] == [0, 3, 4, 6]  # 4: its validation
    assert "val loss 2.0000  val ppl 7.39" in lines[2]
    with progress_reporter(40, enabled=True) as show:  # the default: about ten a run
        for k in range(40):
            show({**rows[0], "step": k})
    assert sum(line.startswith("step") for line in capsys.readouterr().out.splitlines()) == 11


@pytest.mark.slow  # launches a rank through torchrun
def test_cli_run_reports_validation_in_rows_progress_and_summary(tmp_path, capfd):
    out = tmp_path / "m.jsonl"  # the rank's lines come through the file descriptors
    code, text = _cli([*BASE_ARGS[:-1], "3", "--data", str(token_file()), "--eval-every", "2",
                       "--eval-data", str(held_out_file()), "--log-every", "2",
                       "--metrics-out", str(out)], capfd)
    assert code == 0, text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "step" in r and not r.get("summary")}
    assert [s for s, r in steps.items() if "val_loss" in r] == [1, 2]
    assert rows[-1]["val_loss"] == steps[2]["val_loss"]
    lines = [line for line in text.splitlines() if re.match(r"step +\d+  loss", line)]
    # --log-every 2: steps 0 and 2; step 1 for its validation
    assert [int(line.split()[1]) for line in lines] == [0, 1, 2]
    assert "val loss" in lines[1] and "val loss" not in lines[0]
    assert f"(val {steps[2]['val_loss']:.4f})" in text.splitlines()[-1]


@pytest.mark.slow  # the fault-tolerant launcher and its replicas' process trees
def test_fault_tolerant_replicas_report_the_single_process_validation(tmp_path, capfd):
    """Each replica evaluates the whole held-out set on its own ranks: the job's rows hold
    the single-process run's val_loss; the launcher's step lines number steps from 0."""
    out = tmp_path / "ft.jsonl"
    sets = [a for s in (*BASE, *DENSE) for a in ("--set", s)]
    code, text = _cli(["train", "--data", str(token_file()), *sets, "--dp-replicate", "2",
                       "--zero", "1", "--fault-tolerance", "--eval-every", "2", "--eval-data",
                       str(held_out_file()), "--metrics-out", str(out)], capfd)
    assert code == 0, text
    rows = [json.loads(line) for line in out.read_text().splitlines()][:-1]
    want = val_losses(run("single")[0])
    got = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=PARITY_TOLERANCES["fp64"]["loss_rtol"])
    lines = [line for line in text.splitlines() if re.match(r"step +\d+ of 4 ", line)]
    assert [int(line.split()[1]) for line in lines] == [0, 1, 2, 3], text
    assert "val loss" in lines[1] and "val loss" not in lines[0]
