import torch

# one intra-op thread per process: forked ranks share 2 cores (docs/architecture.md, Facts)
torch.set_num_threads(1)


import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from plait.device.network import process_tree  # noqa: E402


def _live_descendants() -> set[int]:
    """This process's descendants that still run (a zombie has exited: not counted)."""
    live = set()
    for pid in process_tree(os.getpid())[1:]:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            live.add(pid)
    return live


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


@pytest.fixture(autouse=True)
def no_child_outlives_its_test():
    """Every process a test starts has ended when the test ends (10 s of grace for the ones
    being torn down); a leftover is killed and the test errors, naming it."""
    before = _live_descendants()
    yield
    deadline = time.monotonic() + 10
    while (left := _live_descendants() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        named = {pid: _command(pid) for pid in left}
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"processes outlived the test (killed now): {named}")


@pytest.fixture(scope="session")
def pipeline_cli_run(tmp_path_factory) -> dict:
    """One `plait train` through the CLI (tests/helpers.py, cli_pipeline_run): 2 ranks,
    pp=2, the memory step measured, metrics to m.jsonl and, where the packages are
    installed, to --tensorboard and --wandb. The sinks' tests and the report's share it."""
    from helpers import cli_pipeline_run

    return cli_pipeline_run(tmp_path_factory.mktemp("pipeline-cli"))



# `make test` runs `-n 2 --dist loadfile`: a file's tests go to one worker (they share its
# module fixtures and cached runs). Files that share a run go to one worker together, so that
# it is made once per session: the session fixture pipeline_cli_run, and test_checkpoint's
# cached full runs (`_full`) that the atomic and background-save tests resume from. (xdist's
# own loadgroup does not group under pytest 9: it renames `_nodeid`, which pytest 9 no
# longer reads.)
SHARED_RUNS = {"test_metric_sinks.py": "pipeline_cli_run",
               "test_report_html.py": "pipeline_cli_run",
               "test_checkpoint.py": "checkpoint_full_runs",
               "test_checkpoint_atomic.py": "checkpoint_full_runs",
               "test_checkpoint_async.py": "checkpoint_full_runs"}

# Files whose tests go to the workers by parameter instead of whole: the parity matrix, a
# row's tests (its parity, ledger and memory checks, and the round trips that resume from
# its checkpoint) on one worker, the rows spread over both.
SPLIT_BY_PARAMETER = {"test_matrix.py"}


def split_by_parameter(nodeid: str) -> str:
    """The scheduling group of a parametrised test: its parameter id, a round trip's
    (`SRC -> DST`) its source row's."""
    param = nodeid.split("[", 1)[1].rsplit("]", 1)[0]
    return param.split(" -> ")[0]


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # without xdist the suite runs serially: nothing to group
    LoadFileScheduling = None

if LoadFileScheduling is not None:
    class _FilesSharingARun(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            name = path.rsplit("/", 1)[-1]
            if name in SPLIT_BY_PARAMETER and "[" in nodeid:
                return f"{path}::{split_by_parameter(nodeid)}"
            return SHARED_RUNS.get(name, path)

    @pytest.hookimpl(tryfirst=True)  # before xdist's own scheduler choice
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadfile":
            return _FilesSharingARun(config, log)
        return None
