"""`torchrun -m plait.train`: one rank of a training job, the documented entry on a
cluster and what `plait train` launches; the rank's code lives in the CLI layer
(plait/cli/rank.py), and this module only keeps that `-m` name working."""

from plait.cli.rank import run

if __name__ == "__main__":
    run()
