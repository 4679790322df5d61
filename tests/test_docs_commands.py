"""Every `plait` command in README.md and docs/*.md works as written
(tests/docs_commands.py reads them).

Cheap by design, each document in a directory of its own, its commands in order (a
`plait plan --emit-config run.toml` makes the config a later `plait train --config
run.toml` reads; docs/usage.md's TOML example is `run.toml` before that):
- `plait train`: its flags parsed and the configuration validated against the world, as
  `plait train` does before it launches (nothing launched, no model built; so big models
  such as llama3-8b cost nothing and are not scaled down);
- `plait cluster`: its flags parsed, and the train flags after `--` validated as above;
- `plait plan` and `plait simulate`: run for real (a second or less each), except a
  plan on a `--hardware` profile, which `plait calibrate` makes: parsed;
- every other command (report, checkpoint, eval, export, data, calibrate) needs files an
  earlier command makes, or minutes: its flags parsed by plait's own parser;
- `--help`: run.
"""

import re

import pytest
from docs_commands import DOCS, ROOT, doc_commands, parse, toml_example, train_problems

from plait.cli.main import main

COMMANDS = doc_commands()
RUN = ("plan", "simulate")


def check(argv: list[str]) -> None:
    """Fails (SystemExit 2 or an assertion naming the problems) where the user's command
    would exit 2."""
    sub = argv[0]
    if "--help" in argv or "-h" in argv:
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
    elif sub == "train":
        problems = train_problems(argv[1:])
        assert not problems, problems
    elif sub == "cluster":
        train_args = parse(argv).train_args
        problems = train_problems(train_args[1:] if train_args[:1] == ["--"] else train_args)
        assert not problems, problems
    elif sub in RUN and "--hardware" not in argv:
        assert main(argv) == 0
    else:
        parse(argv)


# the planner's searches of these documents take 5-10 s each: the slow tier
HEAVY = {"README.md", "docs/usage.md", "docs/planner.md", "docs/deepseek.md"}


@pytest.mark.parametrize("doc", [
    pytest.param(d, marks=[pytest.mark.slow] if d in HEAVY else [])
    for d in (d.relative_to(ROOT).as_posix() for d in DOCS)])
def test_every_documented_command_works_as_written(doc, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(toml_example())
    failed = []
    for cmd in (c for c in COMMANDS if c.doc == doc):
        try:
            check(list(cmd.argv))
        except (AssertionError, SystemExit) as e:
            failed.append(f"{cmd}\n    {e!r}: {capsys.readouterr().err.strip()[-300:]}")
        capsys.readouterr()
    assert not failed, "\n".join(failed)


def test_the_docs_hold_the_commands_a_user_copies():
    # the reader finds them: the README's quick start, the pipeline and checkpoint docs
    lines = {c.line for c in COMMANDS}
    assert len(COMMANDS) > 80
    assert any("--schedule zb-v" in line and "--resume" in line for line in lines)
    assert {c.argv[0] for c in COMMANDS} >= {"train", "plan", "simulate", "report",
                                               "checkpoint", "eval", "export", "data",
                                               "calibrate", "cluster"}


def test_the_notation_is_expanded():
    from docs_commands import _expand

    assert _expand(["train", "--x", "a|b", "[--y", "1]", "[--layout", "...]", "..."]) == [
        ("train", "--x", "a", "--y", "1"), ("train", "--x", "b", "--y", "1")]


def test_the_docs_do_not_call_built_strategies_unbuilt():
    # MoE blocks and expert parallel train (the README's and docs/expert_parallel.md's
    # --model tiny-moe --ep commands validate above); no doc may say they are refused
    readme = (ROOT / "README.md").read_text()
    unbuilt = readme[readme.index("Not built yet"):].split("\n\n")[0]
    assert "expert parallel" not in unbuilt and "MoE blocks" not in unbuilt
    arch = (ROOT / "docs" / "architecture.md").read_text()
    for claim in ("`n_experts > 0` is refused", "refused until built", "(ep, MoE, and the"):
        assert claim not in arch, claim
    assert any(c.argv[:1] == ("train",) and "--ep" in c.argv for c in COMMANDS)
    # hybrid sharding and fault-tolerant replicas are built; extending.md says where a
    # model block and a change to the training step go
    extending = (ROOT / "docs" / "extending.md").read_text()
    assert not re.search(r"\bnext\b", extending), "extending.md calls something 'next'"
    assert "## A new model block" in extending and "## A change to the training step" in extending
