import torch

# one intra-op thread per process: forked ranks share 2 cores (docs/architecture.md, Facts)
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def pipeline_cli_run(tmp_path_factory) -> dict:
    """One `plait train` through the CLI (tests/helpers.py, cli_pipeline_run): 2 ranks,
    pp=2, the memory step measured, metrics to m.jsonl and, where the packages are
    installed, to --tensorboard and --wandb. The sinks' tests and the report's share it."""
    from helpers import cli_pipeline_run

    return cli_pipeline_run(tmp_path_factory.mktemp("pipeline-cli"))



# `make test` runs `-n 2 --dist loadfile`: a file's tests go to one worker (they share its
# /tmp/plait-tests/<file> folders and module fixtures). The files that share a session
# fixture go to one worker together, so that it is built once. (xdist's own loadgroup
# does not group under pytest 9: it renames `_nodeid`, which pytest 9 no longer reads.)
SHARED_SESSION_RUN = {"test_metric_sinks.py", "test_report_html.py"}  # pipeline_cli_run

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # without xdist the suite runs serially: nothing to group
    LoadFileScheduling = None

if LoadFileScheduling is not None:
    class _FilesSharingARun(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "pipeline_cli_run" if path.rsplit("/", 1)[-1] in SHARED_SESSION_RUN \
                else path

    @pytest.hookimpl(tryfirst=True)  # before xdist's own scheduler choice
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadfile":
            return _FilesSharingARun(config, log)
        return None
