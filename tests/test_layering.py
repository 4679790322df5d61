"""Layers only import downward (issue 9): every `plait` module's imports, read with `ast`,
against the declared order below. A module may import its own layer and any layer below.

`KNOWN_UPWARD` lists the upward imports that exist today, each to be removed by issue 9's
refactor (the schedule registry, flag tables below the CLI, the token loss below
`parallel`, the memory meter below `train`). The test is a ratchet: a new upward import
fails it, and so does an entry that no longer exists (delete it).
"""

import ast
from pathlib import Path

PLAIT = Path(__file__).resolve().parent.parent / "plait"

# innermost first; a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("package", ["plait"]),  # plait/__init__.py (empty); a module matching no longer prefix
    ("model", ["plait.model"]),
    ("config", ["plait.config"]),
    ("device", ["plait.device"]),  # where a rank computes: torch only
    ("ledger", ["plait.comm.ledger"]),  # the mesh carries the rank's ledger
    ("mesh", ["plait.mesh"]),
    ("placement", ["plait.placement"]),
    ("optim", ["plait.optim"]),  # the update maths: torch only, no communication
    ("comm", ["plait.comm"]),
    ("parallel", ["plait.parallel"]),
    ("train", ["plait.train"]),
    ("plan", ["plait.plan"]),
    ("observe", ["plait.observe"]),
    ("testing", ["plait.testing"]),
    ("cli", ["plait.cli", "plait.train.__main__"]),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}

KNOWN_UPWARD = {
    ("plait.config", "plait.parallel.pipeline.partition"),  # validation: schedule registry
    ("plait.config", "plait.parallel.pipeline.schedules"),
}


def layer_of(module: str) -> str | None:
    best, hit = -1, None
    for name, prefixes in LAYERS:
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and len(pre) > best:
                best, hit = len(pre), name
    return hit


def _module_name(path: Path) -> str:
    parts = path.relative_to(PLAIT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules imported, `from plait import comm` resolved to `plait.comm`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("plait")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "plait":
                out |= {f"plait.{a.name}" for a in node.names}
            elif node.module.startswith("plait."):
                out.add(node.module)
    return out


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(PLAIT.rglob("*.py")):
        me = _module_name(path)
        mine = layer_of(me)
        for target in _imports(path):
            theirs = layer_of(target)
            if RANK[theirs] > RANK[mine]:
                found.add((me, target))
    return found


def test_layers_only_import_downward():
    found = upward_imports()
    new = found - KNOWN_UPWARD
    assert not new, f"upward imports (a layer importing one above it): {sorted(new)}"
    gone = KNOWN_UPWARD - found
    assert not gone, f"fixed, delete from KNOWN_UPWARD: {sorted(gone)}"


def test_only_the_cli_layer_imports_the_cli():
    found = {(a, b) for a, b in upward_imports() if layer_of(b) == "cli"}
    assert found <= {("plait.observe.report", "plait.cli")}, found


def test_pipeline_ir_imports_nothing_else_from_plait():
    assert _imports(PLAIT / "parallel" / "pipeline" / "ir.py") == set()
