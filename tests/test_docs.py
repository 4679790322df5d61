"""The documentation is a reference a user can read: each docs/*.md at most 400 lines, no
issue numbers and no dated history in it (dated measurements live in docs/results/, each
file naming the benchmark command that regenerates it), and every relative link in
README.md and docs/ points to a file (and heading) that exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
MAX_LINES = 400

REFERENCE = sorted(DOCS.glob("*.md"))
LINKED = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

ISSUE = re.compile(r"(?<![\w-])issue\s*#?\d+", re.I)  # "issue 12", "Issue #7"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d{1,2} (January|February|March|April|May|June|"
                  r"July|August|September|October|November|December)\b|\b(January|February|"
                  r"March|April|May|June|July|August|September|October|November|December) "
                  r"20\d\d\b")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _),
    spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for h in HEADING.findall(_prose(path.read_text())):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


@pytest.mark.parametrize("doc", REFERENCE, ids=_rel)
def test_each_doc_is_at_most_400_lines(doc):
    n = len(doc.read_text().splitlines())
    assert n <= MAX_LINES, f"{_rel(doc)}: {n} lines; split it by topic (at most {MAX_LINES})"


@pytest.mark.parametrize("doc", REFERENCE, ids=_rel)
def test_no_doc_names_an_issue_or_a_date(doc):
    text = doc.read_text()
    issues = sorted({m.group(0) for m in ISSUE.finditer(text)})
    assert not issues, f"{_rel(doc)} names issues {issues}: say what, not which ticket"
    dates = sorted({m.group(0) for m in DATE.finditer(text)})
    assert not dates, (f"{_rel(doc)} carries dates {dates}: a measurement belongs in "
                       "docs/results/, written by its benchmark")


@pytest.mark.parametrize("doc", LINKED, ids=_rel)
def test_every_relative_link_points_to_a_file_and_heading_that_exist(doc):
    broken = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert not broken, f"{_rel(doc)}:\n" + "\n".join(broken)


RESULT_FILES = sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md")
REGENERATE = re.compile(r"^Regenerate: `python (benchmarks/[\w-]+\.py)\b[^`]*--write "
                        r"docs/results/([\w-]+\.md)[^`]*`$", re.M)


@pytest.mark.parametrize("result", RESULT_FILES, ids=_rel)
def test_each_result_names_the_benchmark_that_writes_it(result):
    head = "\n".join(result.read_text().splitlines()[:5])
    m = REGENERATE.search(head)
    assert m, (f"{_rel(result)}: its top must say `Regenerate: python benchmarks/NAME.py "
               f"... --write docs/results/{result.name}`")
    script, target = ROOT / m.group(1), m.group(2)
    assert target == result.name, f"{_rel(result)}: its command writes {target}"
    assert script.exists(), f"{_rel(result)}: no {m.group(1)}"
    assert "add_write_flag" in script.read_text(), f"{m.group(1)} has no --write option"
    assert re.search(r"^Run: .+", result.read_text(), re.M), (
        f"{_rel(result)}: say when and on what machine it ran")


def test_the_results_index_lists_every_result():
    index = (RESULTS / "README.md").read_text()
    missing = [p.name for p in RESULT_FILES if f"]({p.name})" not in index]
    assert not missing, f"docs/results/README.md does not list {missing}"


def test_slugs_follow_github():
    assert slug("Ranks sharing a host's cores (`host_share.py`)") == (
        "ranks-sharing-a-hosts-cores-host_sharepy")
    assert slug("Overlap and one timeline: `plait train --trace FILE.json`") == (
        "overlap-and-one-timeline-plait-train---trace-filejson")
