"""The public CLI end to end: torchrun launch, metrics file, clear errors before launch."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BASE, config, reference, token_file

from plait.cli.main import main
from plait.testing import assert_parity

SETS = [a for s in BASE for a in ("--set", s)]


def plait(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


@pytest.mark.slow  # torchrun
def test_train_through_torchrun_matches_reference(tmp_path):
    """dp=2 x tp=2 with SP and ZeRO-1 through torchrun: the metrics file's rows and summary,
    and its losses and grad norms against the single-process run (every layout's own
    parity, parameters included, is proven on forked ranks: tests/test_matrix.py)."""
    out = tmp_path / "m.jsonl"
    r = plait("train", "--nproc", "4", "--dp", "2", "--tp", "2", "--sp", "--zero", "1",
              "--data", str(token_file()), *SETS, "--microbatches", "2",
              "--metrics-out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "plait: done: 4 steps on dp=2" in r.stdout and str(out) in r.stdout  # --quiet too
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    steps, summary = rows[:-1], rows[-1]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    for key in ("loss", "tokens", "step_time", "tokens_per_s", "grad_norm", "lr"):
        assert all(key in s for s in steps), key
    assert summary["summary"] and summary["ledger"]["sent_bytes_per_step"] > 0
    assert not out.with_name(out.name + ".partial").exists()  # renamed when complete
    # the model's total on any layout; tp splits rank 0's share
    assert summary["param_count"] == config().model.num_params()
    assert summary["param_count_local"] < summary["param_count"]
    assert {"reduce_scatter@dp", "all_gather@dp", "reduce_scatter@tp",
            "all_gather@tp"} <= set(summary["ledger"]["per_step"])
    # end to end: losses and grad norms from the metrics file (no parameters leave the run)
    assert_parity({"losses": [s["loss"] for s in steps],
                   "grad_norms": [s["grad_norm"] for s in steps]}, reference())


# bad input before launch (the layout against the world and the model, token ids past the
# vocabulary, missing data, ...): tests/test_bad_input.py's table, in this process, and a
# few of its cases through `python -m plait.cli`


def test_data_prepare_user_files(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200
                                              + f"file {i}\n")
    out = tmp_path / "corpus" / "tok.bin"
    code = main(["data", "prepare", *(str(tmp_path / f"doc{i}.txt") for i in range(3)),
                 "--out", str(out), "--vocab-size", "300"])
    assert code == 0
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["source"] == "user" and meta["files"] == 3 and meta["max_token_id"] < 300
    assert out.with_suffix(".tokenizer.json").is_file()
    # the prepared file trains: the same inputs checks and data path as a launched run, in
    # this process (--dry-run: one rank on the fake process group; torchrun launches are
    # the other tests here)
    metrics = tmp_path / "dry.json"
    code = main(["train", "--data", str(out), "--set", "model.vocab_size=300", "--steps", "2",
                 "--global-batch", "2", "--seq-len", "16", "--dry-run", "--metrics-out",
                 str(metrics)])
    assert code == 0 and metrics.is_file()


@pytest.mark.slow  # torchrun
def test_pipeline_trace_and_timeline_through_torchrun(tmp_path):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    r = plait("train", "--nproc", "2", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4",
              "--data", str(token_file()), *SETS, "--trace", str(trace), "--timeline", str(png))
    assert r.returncode == 0, r.stderr
    assert "measured bubble" in r.stdout and "simulated" in r.stdout
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for pid in (0, 1):  # the pipeline's actions in the timeline every layout gets
        mine = [e for e in events if e["pid"] == pid]
        assert {"action.F", "action.B", "forward", "backward", "comm"} <= {e["cat"] for e in mine}
        assert len([e for e in mine if e["cat"] == "action.F"]) == 4  # one per micro-batch
        p2p = [e["args"] for e in mine if e["cat"] == "comm" and e["args"]["tag"] == "pp"]
        assert {a["op"] for a in p2p} == {"send", "recv"} and {a["dim"] for a in p2p} == {"pp"}
        assert all(a["payload_bytes"] > 0 for a in p2p)
    assert png.read_bytes()[:4] == b"\x89PNG"
    # what a person reads: each step's tokens/s, memory and model FLOP/s; the layout with
    # its settings; the step log's tokens/s (the bar's) ending where the summary's is
    steps = [x for x in r.stdout.splitlines() if re.match(r"step +\d+ +loss", x)]
    assert steps and all("tokens/s" in x and "(peak RSS)" in x and "GFLOP/s/rank" in x
                         for x in steps), r.stdout
    assert "dp=1 x pp=2 x cp=1 x tp=1, fp64" in r.stdout
    last = re.search(r"([\d,]+) tokens/s", steps[-1]).group(1)
    assert last == re.search(r"tokens/s\s+([\d,]+)", r.stdout).group(1), r.stdout


@pytest.mark.parametrize("args, messages", [
    # the flag and config checks report every problem at once; the data is opened after
    (["--metrics-out", "{tmp}/adir", "--lr", "nan", "--checkpoint-on-stop"],
     ["--metrics-out {tmp}/adir is a directory", "expected a finite number",
      "--checkpoint-on-stop saves into --checkpoint-dir"]),
    (["--data", "{tmp}/notes.txt"], ["is text, not a token file"]),
])
@pytest.mark.slow  # torchrun
def test_bad_input_under_a_users_own_torchrun(tmp_path, args, messages):
    """`torchrun -m plait.train` without `plait train`: every rank runs the same checks
    before any collective, rank 0 says what is wrong, the ranks exit 2 and none waits
    for a peer (the ranks' collective timeout is longer than this test's limit)."""
    from plait.launch.local import LocalLaunch

    (tmp_path / "adir").mkdir()
    (tmp_path / "notes.txt").write_text("some notes, not tokens\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    rank_args = ["--data", str(token_file()), *SETS, "--dp", "2", "--timeout", "3600",
                 *[a.format(tmp=tmp_path) for a in args]]
    launch = LocalLaunch(2, rank_args, timeout_s=120)  # torch's own torchrun
    r = subprocess.run(launch.command, env=launch.env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode != 0
    assert r.stderr.count("plait: cannot start training:") == 1, r.stderr  # rank 0 only
    for message in messages:
        assert message.format(tmp=tmp_path) in r.stderr, r.stderr
    assert "exitcode  : 2" in r.stderr, r.stderr  # torchrun's report of the first rank out
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_a_pipeline_with_fewer_micro_batches_than_stages_is_warned_of():
    cfg = config("parallel.pp=2", "parallel.microbatches=1", "model.n_layers=4")
    notes = " ".join(cfg.warnings())
    assert "pp=2 with 1 micro-batch per step: about 50% " in notes and "--microbatches 8" in notes
    assert not any("micro-batch per step" in n for n in config(
        "parallel.pp=2", "parallel.microbatches=4", "model.n_layers=4").warnings())


def test_layout_text_names_zero_sp_precision_and_recompute():
    from types import SimpleNamespace

    from plait.train.loop import run_layout

    mesh = SimpleNamespace(describe=lambda: "dp=2 x pp=1 x cp=1 x tp=2 (order innermost "
                           "first: tp,cp,pp,dp)")
    cfg = config("parallel.dp=2", "parallel.tp=2", "parallel.zero=3", "parallel.sp=true",
                 "train.precision=bf16", "train.recompute=selective")
    text = run_layout(cfg, mesh)
    assert text.startswith("dp=2 x pp=1 x cp=1 x tp=2, ZeRO-3, SP, bf16, recompute "
                           "selective (order")


def test_step_gauges_show_mfu_where_the_peak_is_known():
    from plait.plan.hardware import gpu_by_device_name
    from plait.train.progress import Gauges

    h100 = gpu_by_device_name("NVIDIA H100 80GB HBM3")
    assert h100 is not None and gpu_by_device_name("NVIDIA H100 PCIe") is None
    g = Gauges(flops_per_token=6e9, ranks=8, peak_flops=h100.peak_flops,
               memory=lambda: (3 * 2**30, "peak allocated"))
    assert g.text(8 * 0.4 * h100.peak_flops / 6e9) == "mem 3.00 GiB (peak allocated)  MFU 40.0%"
    assert Gauges(flops_per_token=1e9, ranks=2).text(4.0) == "2.00 GFLOP/s/rank"


def test_train_help_lists_every_preset_and_the_real_corpus_folder(capsys):
    from plait.model.presets import PRESETS
    from plait.train.corpus import default_data_dir

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(name in text for name in PRESETS)
    assert f"lives (default ~/{default_data_dir().relative_to(Path.home())})" in text


def test_every_stop_signal_takes_the_launchers_handler():
    """SIGINT, SIGTERM and SIGHUP reach one handler, and leave the previous ones after
    (the launched process tree's stop is tests/test_clean_stop.py's, with SIGINT)."""
    import signal

    from plait.launch.local import on_stop_signals

    seen: list[int] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with on_stop_signals(lambda signum, frame: seen.append(signum)):
        for sig in before:
            signal.raise_signal(sig)
    assert seen == list(before)
    assert {s: signal.getsignal(s) for s in before} == before
