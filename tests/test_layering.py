"""Layers only import downward, and folders are layers: every `plait` module's imports,
read with `ast`, against the declared order below. A module's layer is the top-level
package (or module) of plait/ that holds it, so the tree shows the order: a module may
import its own layer and any layer below, and a new folder or top-level module must be
given its place in `LAYERS` (`test_every_top_level_entry_is_a_layer`).

The "schedule" layer (`plait/schedule/`) is pipeline schedules as data: the IR, the
builders, lowering, checks, the simulator, drawing, the rules and the schedule registry
(`registry.py`, one record per schedule). It sits below config so that config validation
reads the registry without importing torch or the model runtime; it imports nothing but the
standard library, itself and the loose helpers (`test_schedule_layer_is_pure_python`), and
importing it runs only the docstring-only `plait/schedule/__init__.py`. The runtime that
executes the schedules is in the parallel layer (`plait/parallel/pipeline/`).

One layer is not a folder: "package", plait/__init__.py (empty) and the loose helpers
below everything (files.py, throughput.py, cli_parser.py), which import nothing from plait
(`test_loose_helpers_import_no_plait_module`).

`plait/train/__main__.py` is in the cli layer: the rank's code is plait/cli/rank.py, and
that module only keeps `torchrun -m plait.train` working.

`KNOWN_UPWARD` is the ratchet of tolerated upward imports; it is empty: a new upward
import fails the test, and so would an entry that no longer exists. No two modules import
each other, directly or through others, when they are imported (`test_no_import_cycle`);
through imports inside functions only the cycles of `KNOWN_LAZY_CYCLES`, a ratchet too.
"""

import ast
import subprocess
import sys
from pathlib import Path

PLAIT = Path(__file__).resolve().parent.parent / "plait"

LOOSE_HELPERS = ("plait.files", "plait.throughput", "plait.cli_parser")
ENTRY_SHIM = "plait.train.__main__"  # `torchrun -m plait.train`; its code is plait.cli.rank

# innermost first: each layer is one top-level package or module of plait/ (but the one
# above: package)
LAYERS = [
    ("package", ["plait", *LOOSE_HELPERS]),
    ("model", ["plait.model"]),
    ("schedule", ["plait.schedule"]),  # pipeline schedules as data, pure Python
    # one record per parallel dimension: its checks, groups, reductions, checkpoint role
    ("dims", ["plait.dims"]),
    ("config", ["plait.config"]),
    ("device", ["plait.device"]),  # where a rank computes: torch only
    ("ledger", ["plait.ledger"]),  # the mesh carries the rank's ledger
    ("mesh", ["plait.mesh"]),
    ("placement", ["plait.placement"]),
    ("optim", ["plait.optim", "plait.muon"]),  # the update maths: torch only, no communication
    ("comm", ["plait.comm"]),
    ("parallel", ["plait.parallel"]),
    ("checkpoint", ["plait.checkpoint"]),  # save/load what parallelize placed; train drives it
    ("train", ["plait.train"]),
    ("plan", ["plait.plan"]),
    ("observe", ["plait.observe"]),
    ("testing", ["plait.testing"]),  # the parity oracle's tolerances and comparison
    # the process tree: local and multi-node launchers, restarts, the watchdog, plait
    # cluster, and the fork harness (plait.launch.forked) that tests and calibrate use
    ("launch", ["plait.launch"]),
    ("calibrate", ["plait.calibrate"]),  # plait calibrate: forks ranks, trains through train
    ("cli", ["plait.cli", ENTRY_SHIM]),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}

KNOWN_UPWARD: set[tuple[str, str]] = set()


def layer_of(module: str) -> str | None:
    """The layer of the longest matching entry: a module's top-level package, or the
    loose helpers and the entry shim, named whole."""
    best, hit = -1, None
    for name, prefixes in LAYERS:
        for pre in prefixes:
            if (module == pre or module.startswith(pre + ".")) and len(pre) > best:
                best, hit = len(pre), name
    return hit


def _module_name(path: Path) -> str:
    parts = path.relative_to(PLAIT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    path = PLAIT.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Modules imported, `from plait import comm` resolved to `plait.comm` (a submodule
    named in a from-import counts as that submodule)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("plait")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "plait" or node.module.startswith("plait."):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.add(sub if _is_module(sub) else node.module)
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
    assert not found, found


def _modules() -> list[str]:
    return [_module_name(p) for p in sorted(PLAIT.rglob("*.py"))]


def test_every_top_level_entry_is_a_layer():
    """Folders are layers: each top-level package or module of plait/ is named in LAYERS
    (a new one must be placed in the order), and no layer names one that is gone."""
    entries = {".".join(m.split(".")[:2]) for m in _modules()}
    named = {pre for _, prefixes in LAYERS for pre in prefixes if pre.count(".") <= 1}
    assert entries - named == set(), f"give these a place in LAYERS: {sorted(entries - named)}"
    assert named - entries == set(), f"gone, delete from LAYERS: {sorted(named - entries)}"
    assert _is_module(ENTRY_SHIM), "the entry shim is gone"


def test_no_plait_module_imports_the_parity_oracle():
    """plait.testing (the oracle's tolerances and comparison) is the tests' side: what
    production code needs lives in production modules."""
    found = sorted(_module_name(p) for p in PLAIT.rglob("*.py")
                   if "plait.testing" in _every_import(p) and _module_name(p) != "plait.testing")
    assert not found, f"import plait.testing: {found}"


def test_loose_helpers_import_no_plait_module():
    for module in LOOSE_HELPERS:
        path = PLAIT.parent.joinpath(*module.split(".")).with_suffix(".py")
        assert _imports(path) == set(), f"{module} imports {sorted(_imports(path))}"


def _type_checking(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def _plait_targets(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("plait")}
    if not node.module or node.level or not (node.module == "plait"
                                             or node.module.startswith("plait.")):
        return set()
    subs = (f"{node.module}.{a.name}" for a in node.names)
    return {sub if _is_module(sub) else node.module for sub in subs}


def _runtime_imports(path: Path) -> set[str]:
    """The plait modules a module imports when it is imported: its top-level statements'
    (inside `if`, `try` and `with` too), not a function's, and not `if TYPE_CHECKING:`'s,
    which never runs (a type named for annotations only)."""
    out: set[str] = set()

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, ast.Import | ast.ImportFrom):
                out.update(_plait_targets(node))
            elif isinstance(node, ast.If) and not _type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return out


def _every_import(path: Path) -> set[str]:
    """Every plait module a module imports, a function's included (not TYPE_CHECKING's)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.update(_plait_targets(child))
            elif not _type_checking(child):
                visit(child)

    visit(ast.parse(path.read_text()))
    return out


def import_cycles(imports) -> set[frozenset[str]]:
    """The groups of modules that import each other, directly or through others (strongly
    connected components of more than one module). An import of `plait.a.b` is an edge to
    `plait.a.b` only: a package's `__init__` re-exporting its submodules, which import
    their siblings, is how a package works, not a cycle."""
    graph = {_module_name(p): imports(p) for p in sorted(PLAIT.rglob("*.py"))}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v] & graph.keys()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.add(frozenset(group))

    for v in graph:
        if v not in index:
            connect(v)
    return found


# modules that import each other inside functions only (no cycle at import time, but two
# modules a reader has to take in together): a ratchet, each may go, none may be added
KNOWN_LAZY_CYCLES = {
    frozenset({"plait.observe.html", "plait.observe.report", "plait.observe.visuals"}),
}


def test_no_import_cycle():
    """No module imports, when it is imported, one that imports it back."""
    cycles = import_cycles(_runtime_imports)
    assert not cycles, f"modules importing each other: {[sorted(c) for c in cycles]}"


def test_no_cycle_through_lazy_imports_but_the_ratchet():
    cycles = import_cycles(_every_import)
    new = cycles - KNOWN_LAZY_CYCLES
    assert not new, f"new cycles (through function-level imports): {[sorted(c) for c in new]}"
    gone = KNOWN_LAZY_CYCLES - cycles
    assert not gone, f"fixed, delete from KNOWN_LAZY_CYCLES: {[sorted(c) for c in gone]}"



def test_schedule_ir_imports_nothing_else_from_plait():
    assert _imports(PLAIT / "schedule" / "ir.py") == set()


def _all_imports(path: Path) -> set[str]:
    """Top-level names of every module imported (plait's included), at any depth."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_schedule_layer_is_pure_python():
    """No torch, numpy or plait module but the layer's own and the loose helpers: config
    validation imports it."""
    schedule = PLAIT / "schedule"
    for path in sorted(schedule.glob("*.py")):
        # drawing a PNG imports matplotlib inside the function, when asked
        third_party = _all_imports(path) - set(sys.stdlib_module_names) - {"plait", "matplotlib"}
        assert not third_party, f"{path.name} imports {sorted(third_party)}"
        outside = {t for t in _every_import(path) if layer_of(t) not in ("schedule", "package")}
        assert not outside, f"{path.name} imports {sorted(outside)} outside the schedule layer"
    assert _all_imports(schedule / "__init__.py") == set(), "plait/schedule/ must stay import-free"


def test_config_validation_imports_no_torch():
    """Validating (and loading) a pipeline config reads the schedule registry only."""
    code = (
        "import sys\n"
        "from plait.config import load_config\n"
        "cfg = load_config(sets=['parallel.pp=4', 'parallel.schedule=zb-v', "
        "'parallel.microbatches=8', 'model.n_layers=8'])\n"
        "assert cfg.validate() == [], cfg.validate()\n"
        "bad = load_config(sets=['parallel.pp=4', 'parallel.schedule=dualpipe', "
        "'parallel.microbatches=3', 'model.n_layers=2'])\n"
        "assert len(bad.validate()) >= 2, bad.validate()\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'plait.model.transformer', "
        "'plait.parallel.pipeline.partition') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PLAIT.parent)
