"""docs/architecture.md's package map lists every package and module under plait/: a
module appears, by its name, in the entry of its top-level package (a module of a
sub-package after the sub-package's `name/`); a top-level module has an entry of its own."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAIT = ROOT / "plait"


def package_map() -> dict[str, str]:
    """The map's entries: top-level name (`config/`, `mesh.py`) -> its text."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^```\nplait/\n(.*?)^```", text, re.S | re.M).group(1)
    entries: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        m = re.match(r"^  (\S+)\s*(.*)$", line)
        if m:
            name = m[1]
            entries[name] = m[2]
        elif name:
            entries[name] += " " + line.strip()
    return entries


def named(stem: str, text: str) -> bool:
    return re.search(rf"(?<![\w/.-]){re.escape(stem)}(\.py)?(?![\w-])", text) is not None


def missing_from_map() -> list[str]:
    entries = package_map()
    missing = []
    for path in sorted(PLAIT.rglob("*.py")):
        rel = path.relative_to(PLAIT)
        if "__pycache__" in rel.parts or rel.name == "__init__.py" and len(rel.parts) == 2:
            continue
        top = rel.parts[0] + ("/" if len(rel.parts) > 1 else "")
        if top == "__init__.py":
            continue
        if top not in entries:
            missing.append(rel.as_posix())
            continue
        text = entries[top]
        for sub in rel.parts[1:-1]:  # a sub-package: its modules after its `name/`
            at = text.find(f"{sub}/")
            text = text[at + len(sub) + 1:] if at >= 0 else ""
        stem = rel.stem if rel.name != "__init__.py" else None
        if (len(rel.parts) > 1 and stem and stem != "__init__" and not named(stem, text)) \
                or (len(rel.parts) > 2 and not text):
            missing.append(rel.as_posix())
    return missing


def test_every_module_under_plait_is_in_the_architecture_map():
    missing = missing_from_map()
    assert not missing, ("docs/architecture.md's package map does not list: "
                         + ", ".join(missing) + " (add each to its package's entry)")


def test_the_map_is_read_as_entries():
    entries = package_map()
    assert {"config/", "plan/", "mesh.py", "cli/"} <= set(entries)
    assert named("loop", entries["train/"]) and not named("loo", entries["train/"])
