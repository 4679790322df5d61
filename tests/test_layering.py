"""Layers only import downward (issue 9): every `plait` module's imports, read with `ast`,
against the declared order below. A module may import its own layer and any layer below.

The "schedule" layer is the pure-Python half of `plait/parallel/pipeline/`: the IR, the
builders, lowering, checks, the simulator, the rules and the schedule registry
(`registry.py`, one record per schedule). It sits below config so that config validation
reads the registry without importing torch or the model runtime; it imports nothing but
the standard library and itself (`test_schedule_layer_is_pure_python`), and importing it
runs only the docstring-only `plait/parallel/__init__.py` and `.../pipeline/__init__.py`.

`KNOWN_UPWARD` is the ratchet of tolerated upward imports; issue 9's refactor removed the
last of them (the schedule registry below config, the flag tables below the CLI, the
optimizer's maths and the token loss below `parallel`, the memory meter behind the device
seam), so it is empty: a new upward import fails the test, and so would an entry that no
longer exists.
"""

import ast
import subprocess
import sys
from pathlib import Path

PLAIT = Path(__file__).resolve().parent.parent / "plait"

# the schedule layer's modules, in plait/parallel/pipeline/
SCHEDULE_MODULES = ("ir", "schedules", "list_schedule", "lower", "check", "simulate", "results",
                    "rules", "registry")

# innermost first; a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("package", ["plait"]),  # plait/__init__.py (empty); a module matching no longer prefix
    ("model", ["plait.model"]),
    ("schedule", [f"plait.parallel.pipeline.{m}" for m in SCHEDULE_MODULES]),
    ("config", ["plait.config", "plait.config_checks"]),
    ("device", ["plait.device"]),  # where a rank computes: torch only
    ("ledger", ["plait.comm.ledger"]),  # the mesh carries the rank's ledger
    ("mesh", ["plait.mesh"]),
    ("placement", ["plait.placement"]),
    ("optim", ["plait.optim"]),  # the update maths: torch only, no communication
    ("comm", ["plait.comm"]),
    ("parallel", ["plait.parallel"]),
    ("checkpoint", ["plait.checkpoint"]),  # save/load what parallelize placed; train drives it
    ("train", ["plait.train"]),
    ("plan", ["plait.plan"]),
    ("observe", ["plait.observe"]),
    ("testing", ["plait.testing"]),
    ("cli", ["plait.cli", "plait.cluster", "plait.cluster_stale", "plait.launch",
             "plait.elastic", "plait.multinode", "plait.multinode_elastic", "plait.watchdog",
             "plait.calibrate",  # measures through plait.testing's fork harness
             "plait.calibrate_steps",  # and trains through plait.train, for plait calibrate
             "plait.calibrate_tp",  # its tp floor: trains on forked ranks
             "plait.train.__main__", "plait.train.eval_cli"]),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}

KNOWN_UPWARD: set[tuple[str, str]] = set()


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
    assert found <= {("plait.observe.report", "plait.cli")}, found


def test_pipeline_ir_imports_nothing_else_from_plait():
    assert _imports(PLAIT / "parallel" / "pipeline" / "ir.py") == set()


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
    """No torch, numpy or plait module outside the layer: config validation imports it."""
    pipeline = PLAIT / "parallel" / "pipeline"
    for name in SCHEDULE_MODULES:
        path = pipeline / f"{name}.py"
        third_party = _all_imports(path) - set(sys.stdlib_module_names) - {"plait"}
        assert not third_party, f"{path.name} imports {sorted(third_party)}"
        outside = {t for t in _imports(path) if layer_of(t) != "schedule"}
        assert not outside, f"{path.name} imports {sorted(outside)} outside the schedule layer"
    for init in (PLAIT / "parallel" / "__init__.py", pipeline / "__init__.py"):
        assert _all_imports(init) == set(), f"{init} must stay import-free"


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
