"""What a new user reads from `plait`: each subcommand's --help lists its own flags and
says whole sentences; a mistake is one line naming the closest flag, command or choice."""

from __future__ import annotations

import pytest

from plait.cli.main import build_parser, main

SUBCOMMANDS = ("train", "demo", "data", "simulate", "plan", "report", "checkpoint", "eval",
               "export", "calibrate", "cluster")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def _subparsers() -> dict:
    parser = build_parser()
    return next(a for a in parser._actions if hasattr(a, "choices") and a.choices
                and "train" in a.choices).choices


@pytest.mark.parametrize(("argv", "said"), [
    (("train", "--setps", "5"), "did you mean --steps?"),
    (("train", "--nproc", "2", "--setps=5"), "did you mean --steps?"),
    (("plan", "--gpus", "2", "--modle", "tiny"), "did you mean --model?"),
    (("trian",), "did you mean train?"),
    (("data", "prepar"), "did you mean prepare?"),
    (("train", "--schedule", "zbv"), "did you mean zb-v?"),
])
def test_a_mistake_is_one_line_with_the_closest_name(capsys, argv, said):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err  # no usage dump
    assert said in err and "usage:" not in err


def test_a_bad_choice_lists_the_valid_ones(capsys):
    _, _, err = _run(capsys, "train", "--schedule", "nope")
    assert err.startswith("plait train: argument --schedule: invalid choice: 'nope'")
    assert all(name in err for name in ("gpipe", "1f1b", "zb-v", "dualpipe"))
    _, _, err = _run(capsys, "train", "--setps", "5")
    assert err.startswith("plait train: unrecognized arguments: --setps 5")
    assert "(plait train --help lists them)" in err


def test_top_level_help_names_every_subcommand(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    description = out.split("\n\n")[1]  # the paragraph after the usage
    assert all(name in description for name in SUBCOMMANDS), description
    assert set(_subparsers()) == set(SUBCOMMANDS)


def test_every_description_is_whole_sentences():
    for name, sub in _subparsers().items():
        text = (sub.description or "").strip()
        assert not text or text.endswith("."), (name, text[-80:])


def test_eval_help_lists_only_what_an_evaluation_reads(capsys):
    code, out, _ = _run(capsys, "eval", "--help")
    assert code == 0
    for flag in ("--init-from", "--data", "--seq-len", "--tp", "--pp", "--eval-sequences"):
        assert flag in out, flag
    for flag in ("--steps", "--lr", "--zero", "--recompute", "--data-dir", "--model "):
        assert flag not in out, flag
    assert "embedded corpus" not in out and "required" in out


def test_report_help_lists_its_own_flags_and_takes_the_runs(capsys):
    code, out, _ = _run(capsys, "report", "--help")
    assert code == 0
    assert "--metrics" in out and "--config" in out and "--html" in out
    for flag in ("--steps", "--lr", "--dp N", "--recompute", "--schedule"):
        assert flag not in out, flag
    # still taken, for a metrics file that records no configuration
    args = build_parser().parse_args(["report", "--metrics", "m.jsonl", "--dp", "2",
                                      "--pp", "2"])
    assert (args.dp, args.pp) == (2, 2)
