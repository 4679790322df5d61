"""The CLI layer: the `plait` command (main.py; `python -m plait.cli`), one training rank
(rank.py, what `torchrun -m plait.train` runs), `plait eval` / `plait export` and eval's
rank (eval.py). Environment variables are read here and nowhere below."""
