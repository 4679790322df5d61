"""docs/checkpoint.md's command sequence runs as written: its first code block's commands
(tests/docs_commands.py reads them as the shell would), in order, in one directory; a
command that elides flags (`plait train ...`) is left out, an optional `[--flag a|b]`
runs with its first choice. The save trains to its last step; the resharded resume from
an earlier step ends at the loss the uninterrupted run ended at; the resume of the newest
checkpoint trains on; the checkpoint is inspected and consolidated."""

import re
import shlex
import subprocess
import sys

import pytest
from docs_commands import ROOT, _expand, _lines, _strip_comment

DOC = ROOT / "docs" / "checkpoint.md"
DONE = re.compile(r"plait: done: (\d+) steps .* loss ([\d.]+) -> ([\d.]+)")


def documented_sequence() -> list[list[str]]:
    """The first code block's commands after `plait`, as a user would run them."""
    block = re.search(r"^```\n(.*?)^```", DOC.read_text(), re.S | re.M).group(1)
    found = []
    for line in map(_strip_comment, _lines(block)):
        words = shlex.split(line)
        if words[:1] == ["plait"] and "..." not in words:
            found.append(list(_expand(words[1:])[0]))
    return found


def test_the_sequence_saves_resumes_resharded_and_trains_on():
    seq = documented_sequence()
    assert [argv[:2] for argv in seq] == [["train", "--nproc"]] * 3 + [
        ["checkpoint", "inspect"], ["checkpoint", "consolidate"]]
    assert "--resume" in seq[1] and "--resume" in seq[2]


@pytest.mark.slow  # three torchrun launches
def test_the_documented_sequence_runs_as_written(tmp_path):
    done = []
    for argv in documented_sequence():
        r = subprocess.run([sys.executable, "-m", "plait.cli", *argv], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"plait {shlex.join(argv)}:\n{r.stderr[-2000:]}"
        m = DONE.search(r.stdout + r.stderr)
        if argv[0] == "train":
            assert m, r.stdout[-1000:]
            done.append((int(m[1]), float(m[3])))
    (saved, saved_loss), (resharded, resharded_loss), (on, _) = done
    assert saved == 20 and resharded == 10 and on == 10
    assert resharded_loss == pytest.approx(saved_loss, rel=1e-3)
    assert (tmp_path / "ck" / "step-00000030").is_dir()
    assert (tmp_path / "model.safetensors").stat().st_size > 0
