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
