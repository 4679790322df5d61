"""`plait report --html FILE / --png-dir DIR`: the outputs checked before anything is
read, then the figures drawn once and written as a page, as files, or both."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from plait.config import Config
from plait.files import artifact_problems, directory_problems

NO_PLAN = ("the metrics file records no configuration, so the planner has nothing to "
           "predict from: pass --config run.toml or the run's train flags beside --metrics")


def visual_problems(args: argparse.Namespace) -> list[str]:
    """--html and --png-dir: writable, not an input, and matplotlib there to draw."""
    problems: list[str] = []
    inputs = [args.metrics] + [f for f in (args.config, getattr(args, "plan", None)) if f]
    if args.html is not None:  # a page is an artifact: replaced only with --force
        problems += artifact_problems("--html", args.html, inputs, getattr(args, "force", False))
    if args.png_dir is not None:
        problems += directory_problems("--png-dir", args.png_dir)
    if (args.html is not None or args.png_dir is not None) and (
            importlib.util.find_spec("matplotlib") is None):
        problems.append("--html and --png-dir draw with matplotlib, which is not installed: "
                        "pip install 'plait[plot]'")
    return problems


def write_visuals(args: argparse.Namespace, rows: list[dict], summary: dict,
                  cfg: Config | None, rep: dict | None) -> None:
    """Draw the figures once; write the page and/or the PNG files; say where."""
    from plait.observe.figures import figures
    from plait.observe.html import render_html, write_html, write_pngs

    pngs, why = figures(rows, summary, rep, None if rep is not None else NO_PLAN)
    out = sys.stderr if args.json else sys.stdout  # --json keeps stdout parseable
    if rep is None:
        print(f"plait: note: {NO_PLAN}", file=sys.stderr)
    if args.html:
        config = cfg.to_dict() if cfg is not None else summary.get("config")
        title = f"plait run: {summary.get('layout', 'layout unknown')} ({Path(args.metrics).name})"
        page = render_html(rows, summary, config, rep, pngs, why, title)
        print(f"report page: {write_html(page, args.html)}", file=out)
    if args.png_dir:
        paths = write_pngs(pngs, args.png_dir)
        print(f"figures: {', '.join(str(p) for p in paths)}", file=out)
