"""`plait report --html FILE --png-dir DIR`: one self-contained page and the same
figures as files, for a pipeline run, a data-parallel ZeRO run and a run without a plan.

The page is read with html.parser (always), and rendered by headless Chromium where one
is installed (skipped otherwise, saying so): no external URL anywhere, every image a
`data:` PNG that decodes and is not blank, every section there, and each section's
numbers those of `plait report --json` (the same comparison).
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers import run_layout, token_file

from plait.cli.main import main
from plait.observe.figures import MEASURED, PREDICTED
from plait.observe.html import SECTIONS
from plait.train.progress import human_bytes

# the run they read is `plait train` through torchrun (tests/conftest.py, pipeline_cli_run)
pytestmark = pytest.mark.slow

pytest.importorskip("matplotlib", reason="the report's figures need plait[plot]")

# pp2: the CLI run the sinks' tests make (tests/conftest.py); dp2-zero1: forked ranks
LAYOUTS = ("pp2", "dp2-zero1")
# fp32: the report compares memory with the eager model, which prices fp32 and bf16 runs
DP_SETS = ["train.precision=fp32", "parallel.dp=2", "parallel.zero=1", "train.steps=2",
           "train.memory_step=1"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
BROWSER = next((b for b in map(shutil.which, BROWSERS) if b), None)


class Page(HTMLParser):
    """Every tag's attributes, the section ids, the images by alt and each section's text."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.sections: dict[str, str] = {}
        self._section: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "section":
            self._section = attrs["id"]
            self.sections[self._section] = ""

    def handle_data(self, data):
        if self._section is not None:
            self.sections[self._section] += data + " "

    @property
    def images(self) -> dict[str, str]:
        return {a["alt"]: a["src"] for t, a in self.tags if t == "img"}


def _write_metrics(path: Path, out: dict, keep_config: bool = True) -> Path:
    summary = dict(out["summary"])
    if not keep_config:
        del summary["config"]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*out["metrics"], summary]))
    return path


@pytest.fixture(scope="module")
def reports(tmp_path_factory, pipeline_cli_run) -> dict:
    """Per layout: the run's rank 0 output, the page and the PNG directory."""
    d = tmp_path_factory.mktemp("reports")
    runs = {"pp2": pipeline_cli_run,
            "dp2-zero1": run_layout(*DP_SETS, f"train.data={token_file()}")[0]}
    got = {}
    for name, out in runs.items():
        metrics = _write_metrics(d / f"{name}.jsonl", out)
        page, figs = d / f"{name}.html", d / f"{name}-figs"
        assert main(["report", "--metrics", str(metrics), "--json", "--html", str(page),
                     "--png-dir", str(figs)]) == 0
        got[name] = {"out": out, "metrics": metrics, "page": page, "figs": figs}
    return got


def _decoded_png(src: str) -> bytes:
    head = "data:image/png;base64,"
    assert src.startswith(head), src[:40]
    return base64.b64decode(src[len(head):], validate=True)


def _pixels(png: bytes):
    import matplotlib.image

    assert png.startswith(PNG_MAGIC)
    return matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]


def _assert_not_blank(png: bytes) -> None:
    pixels = _pixels(png)
    assert pixels.shape[0] > 50 and pixels.shape[1] > 50
    # a drawn figure here measures 0.13-0.29 (white with curves, bars, text); blank is 0
    assert pixels.std() > 0.02, "a blank (one-colour) image"


def _has_colour(png: bytes, hex_colour: str) -> bool:
    rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return bool((abs(_pixels(png) - rgb).max(axis=-1) < 0.02).sum() > 100)


@pytest.mark.parametrize("name", LAYOUTS)
def test_page_is_self_contained_and_complete(reports, name):
    page = Page(reports[name]["page"].read_text(encoding="utf-8"))
    for tag, attrs in page.tags:  # nothing fetched from anywhere: no URL, script or link
        assert tag not in ("script", "link", "iframe", "object", "embed"), tag
        for key in ("src", "href", "srcset", "data", "action"):
            value = attrs.get(key) or ""
            assert not value.startswith(("http:", "https:", "//", "file:")), (tag, key, value)
    text = reports[name]["page"].read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "url(" not in text
    assert list(page.sections) == list(SECTIONS)
    expected = {"loss", "throughput", "memory", "communication", "overlap"}
    if name == "pp2":
        expected |= {"bubble", "timeline"}
    assert set(page.images) == expected
    for src in page.images.values():
        _assert_not_blank(_decoded_png(src))
    for figure in ("memory", "communication"):  # both bars drawn: planner and measured
        png = _decoded_png(page.images[figure])
        assert _has_colour(png, PREDICTED) and _has_colour(png, MEASURED), figure
    if name != "pp2":
        assert "pp=1: the run has no pipeline" in page.sections["pipeline"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_png_dir_holds_the_pages_figures(reports, name):
    page = Page(reports[name]["page"].read_text(encoding="utf-8"))
    files = {p.stem: p.read_bytes() for p in reports[name]["figs"].iterdir()}
    assert files == {alt: _decoded_png(src) for alt, src in page.images.items()}


def test_page_numbers_are_the_runs(reports, capsys):
    """The memory table holds the measured bytes of the run's memory step, the
    communication table the ledger's bytes per step, the bubble the summary's."""
    for r in reports.values():
        page = Page(r["page"].read_text(encoding="utf-8"))
        row = next(m for m in r["out"]["metrics"] if "memory" in m)
        for cat in ("params", "grads", "optimizer", "activations"):
            assert human_bytes(row["memory"]["peak"][cat]) in page.sections["memory"], cat
        ledger = r["out"]["summary"]["ledger"]["per_step"]
        for key, entry in ledger.items():
            op, dim = key.split("@")
            assert f"{op} x{entry['count']:g}" in page.sections["communication"], key
        assert r["out"]["summary"]["layout"] in page.sections["run"]
    bubble = reports["pp2"]["out"]["summary"]["pipeline"]["measured_bubble"]
    assert f"{100 * bubble:.1f} %" in Page(reports["pp2"]["page"].read_text()).sections[
        "pipeline"]


def test_a_run_without_a_plan_says_why(reports, tmp_path, capsys):
    """No configuration recorded (and none given): the curves and the pipeline still
    drawn; memory, communication and overlap say what is missing and how to get it.
    Without --html the report is refused as before (nothing to compare)."""
    metrics = _write_metrics(tmp_path / "m.jsonl", reports["pp2"]["out"], keep_config=False)
    assert main(["report", "--metrics", str(metrics)]) == 2
    page_path = tmp_path / "r.html"
    assert main(["report", "--metrics", str(metrics), "--html", str(page_path)]) == 0
    assert "records no configuration" in capsys.readouterr().err
    page = Page(page_path.read_text(encoding="utf-8"))
    assert list(page.sections) == list(SECTIONS)
    for section in ("memory", "communication", "overlap"):
        assert "records no configuration" in page.sections[section], section
        assert "--config" in page.sections[section]
    assert set(page.images) == {"loss", "throughput", "bubble", "timeline"}


@pytest.mark.skipif(BROWSER is None, reason="no Chromium or Chrome on PATH (chromium, "
                    "google-chrome): the page is checked by html.parser only")
def test_page_renders_in_headless_chromium(reports, tmp_path):
    """A real browser draws the page: the screenshot is not blank and the browser logged
    no console error (a resource it could not load, a script error)."""
    shot = tmp_path / "page.png"
    page = reports["pp2"]["page"]
    r = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1100,2400", "--enable-logging=stderr", "--v=0",
         f"--screenshot={shot}", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _assert_not_blank(shot.read_bytes())
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line
               or "Failed to load resource" in line or "Uncaught" in line]
    assert not console, "\n".join(console)
