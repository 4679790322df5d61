"""The house's shape, enforced: no function in plait/ over 80 lines, none in the training
loop over 6 parameters (a step reads the run's parts from one object).

A reader should be able to take in a function at once. A module holds one topic, of a size
a reader takes in one sitting: that is a judgement, not a line count, so no test holds
modules to a length. A module is split by topic, where it holds two, never to meet a
number."""

import ast
from pathlib import Path

PLAIT = Path(__file__).resolve().parent.parent / "plait"
MAX_FUNCTION_LINES = 80


def _modules():
    for path in sorted(PLAIT.rglob("*.py")):
        yield path.relative_to(PLAIT).as_posix(), path.read_text()


def test_no_function_over_80_lines():
    long = []
    for rel, src in _modules():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "split into named steps:\n" + "\n".join(long)


MAX_LOOP_PARAMETERS = 6


def test_no_function_of_the_loop_over_6_parameters():
    src = (PLAIT / "train" / "loop.py").read_text()
    wide = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            n = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg)
                 + bool(a.kwarg))
            if n > MAX_LOOP_PARAMETERS:
                wide.append(f"train/loop.py:{node.lineno} {node.name} ({n} parameters)")
    assert not wide, "pass the run's parts in one object:\n" + "\n".join(wide)
