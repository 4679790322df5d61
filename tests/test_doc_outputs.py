"""Every command output the docs show is what the command prints now: each block marked
`<!-- plait-output: COMMAND -->` in README.md and docs/*.md against its command run
again (tests/regen_docs.py, which also rewrites them). A `plait plan` search takes
seconds and a dry run forks a rank: those blocks are the slow tier; every other block
runs in the fast tier."""

import re

import pytest
from regen_docs import (
    DOCS,
    MarkedBlock,
    MarkError,
    apply_filter,
    main,
    mark_problems,
    marked_blocks,
    regenerate,
    render,
    split_pipeline,
    stale,
)

BLOCKS = [b for path in DOCS for b in marked_blocks(path)]


@pytest.mark.parametrize("block", [
    pytest.param(b, marks=[pytest.mark.slow] if b.is_slow() else [])
    for b in BLOCKS], ids=lambda b: f"{b.doc}:{' '.join(b.argv()[:4])}")
def test_each_marked_block_is_what_its_command_prints_now(block):
    diff = stale(block)
    assert not diff, (f"{block.doc} shows stale output; run `.venv/bin/python "
                      f"tests/regen_docs.py {block.doc}`:\n{diff}")


def test_the_docs_mark_their_command_outputs():
    # the planner's numbers the docs quote (float8, DeepSeek-V3, goodput) come from blocks
    docs = {b.doc for b in BLOCKS}
    assert {"docs/float8.md", "docs/deepseek.md", "docs/planner.md",
            "docs/pipeline_schedules.md"} <= docs, docs
    for path in DOCS:
        opened = len(re.findall(r"^<!-- plait-output:", path.read_text(), re.M))
        assert opened == len(marked_blocks(path)), (
            f"{path.name}: a `<!-- plait-output: ... -->` mark without its ```text block "
            "and `<!-- /plait-output -->` right after it")


def test_a_stale_block_is_found_and_rewritten(tmp_path):
    doc = tmp_path / "doc.md"
    cmd = "plait simulate --schedule gpipe --pp 2 --microbatches 2 --show | tail -n 3"
    doc.write_text(f"text\n<!-- plait-output: {cmd} -->\n```text\n$ {cmd}\nold\n```\n"
                   "<!-- /plait-output -->\nmore text\n")
    (block,) = marked_blocks(doc)
    assert "-old" in stale(block)
    assert regenerate(doc) == [cmd]
    (block,) = marked_blocks(doc)
    assert not stale(block) and doc.read_text().endswith("<!-- /plait-output -->\nmore text\n")
    assert block.shown.splitlines()[1] == "gpipe  pp=2 m=2 v=1  (time grid: F=I=W=1, B=2)"
    assert regenerate(doc) == []


def test_the_filters_and_their_refusals():
    lines = ["a1", "b2", "a3"]
    assert apply_filter(["head", "-n", "2"], lines) == ["a1", "b2"]
    assert apply_filter(["tail", "-n", "1"], lines) == ["a3"]
    assert apply_filter(["grep", "-E", "^a"], lines) == ["a1", "a3"]
    assert apply_filter(["grep", "-v", "-E", "^a"], lines) == ["b2"]
    with pytest.raises(MarkError, match="use one of head -n N"):
        apply_filter(["sort"], lines)
    with pytest.raises(MarkError, match="mark a `plait ...` command"):
        split_pipeline("python x.py | head -n 2")
    assert split_pipeline("plait plan --gpus 8 | grep -E 'a|b'") == [
        ["plait", "plan", "--gpus", "8"], ["grep", "-E", "a|b"]]
    with pytest.raises(MarkError, match="exited 2"):
        render("plait simulate --pp 0")
    assert MarkedBlock("d", "plait plan --model x", "").is_slow()
    assert MarkedBlock("d", "plait train --dry-run", "").is_slow()
    assert not MarkedBlock("d", "plait plan --layout dp=8", "").is_slow()


def test_bad_marks_are_named_before_any_rewrite(tmp_path, capsys):
    good = "plait simulate --pp 2 --microbatches 2 | head -n 1"
    doc = tmp_path / "doc.md"
    text = "".join(f"<!-- plait-output: {c} -->\n```text\nold\n```\n<!-- /plait-output -->\n"
                   for c in (good, "plait simulate | sort", "plait simulate | grep -E '('"))
    doc.write_text(text)
    problems = mark_problems([doc, tmp_path / "missing.md"])
    assert len(problems) == 3 and "use one of" in problems[0] and "missing.md" in problems[2]
    assert main([str(doc)]) == 2
    assert doc.read_text() == text  # the good block was not rewritten either
    assert "nothing rewritten" in capsys.readouterr().err
