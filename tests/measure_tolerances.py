"""Re-measure the parity tolerances: every test that calls `assert_parity`, run once under
each CPU kernel path (`ATEN_CPU_CAPABILITY`: default, avx2, and avx512 where the CPU has
it) with every comparison's errors recorded (tests/parity_record_plugin.py), the worst
error of each tolerance class and check over all of them, and the table in docs/parity.md
rewritten from them.

    .venv/bin/python tests/measure_tolerances.py           # every path, both tiers
    .venv/bin/python tests/measure_tolerances.py --no-write   # `make test-isa`: fast tier
    .venv/bin/python tests/measure_tolerances.py --isa avx2          # one path
    .venv/bin/python tests/measure_tolerances.py --from runs.jsonl   # table from a record
    .venv/bin/python tests/measure_tolerances.py --keep after.jsonl --same-as before.jsonl

`--same-as`: a refactor's proof that nothing changed in behaviour: every comparison's
errors (each test, tolerance class and check) equal to the last digit to those of an
earlier record (made with `--keep` on the earlier commit); exit 1 otherwise.

Two kinds of bound (plait.testing): a derived one (float64's or fp32's epsilon times a
stated growth) must be at least the worst error measured on every path; a measured one
(bf16, float8 over bf16) must sit between the worst error over every path and 3x that
error (tests/test_parity_tolerances.py holds plait.testing.PARITY_TOLERANCES to the
table). The script prints every bound that breaks its rule and exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plait.testing import (  # noqa: E402
    DERIVED_CHECKS,
    DERIVED_CLASSES,
    PARAM_GROWTH,
    PARITY_TOLERANCES,
)

DOC = ROOT / "docs" / "parity.md"
BEGIN, END = "<!-- tolerances:begin -->", "<!-- tolerances:end -->"
MAX_HEADROOM = 3.0
PATHS = ("default", "avx2", "avx512")


def cpu_paths() -> list[str]:
    """The kernel paths this CPU runs: avx2 and avx512 only where its flags have them."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    have = {"default": True, "avx2": "avx2" in flags, "avx512": "avx512f" in flags}
    return [p for p in PATHS if have[p]]


def parity_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "assert_parity(" in p.read_text())


def record(path: Path, files: list[str], isa: str, fast_only: bool) -> int:
    """The parity tests under one kernel path, their comparisons appended to `path`;
    `fast_only`: `make test`'s tier only (the slow tier's process trees left out)."""
    cmd = [sys.executable, "-m", "pytest", *files, "-n", "2", "--dist", "loadfile", "-q",
           "-o", "addopts=", *(["-m", "not slow"] if fast_only else []),
           "-p", "tests.parity_record_plugin", "--parity-record", str(path),
           "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATEN_CPU_CAPABILITY": isa}
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def worst_errors(lines: list[dict]) -> dict[tuple[str, str], tuple[float, str, int, dict]]:
    """(class, check) -> (worst error, the test and place it was seen, comparisons, the
    worst error on each kernel path)."""
    out: dict[tuple[str, str], tuple[float, str, int, dict]] = {}
    for rec in lines:
        isa = rec.get("isa", "?")
        for key, (err, where) in rec["errors"].items():
            k = (rec["precision"], key)
            best, at, n, paths = out.get(k, (-1.0, "", 0, {}))
            if err > best:
                best, at = err, f"{rec['test'].removeprefix('tests/')} ({where}; {isa})"
            out[k] = (best, at, n + 1, {**paths, isa: max(err, paths.get(isa, -1.0))})
    return out


def how(precision: str, key: str) -> str:
    """How a bound is set: epsilon x growth (derived) or measured over the paths."""
    if precision in DERIVED_CLASSES and key in DERIVED_CHECKS:
        eps, growth = DERIVED_CLASSES[precision]
        growth *= PARAM_GROWTH if key == "param_lr_rtol" else 1
        return f"2^{growth.bit_length() - 1} eps{64 if eps < 1e-10 else 32}"
    if precision in DERIVED_CLASSES:
        return "exact"
    return "measured"


def table(worst: dict[tuple[str, str], tuple[float, str, int, dict]]
          ) -> tuple[str, list[str], list[str]]:
    rows = ["| class | check | bound | set as | worst measured | worst by path (default / "
            "avx2 / avx512) | bound / worst | comparisons | worst seen in |",
            "|---|---|---|---|---|---|---|---|---|"]
    # problems: a bound below its worst error; loose: a measured bound over 3x its worst, or
    # a check nothing measured (a rule of the written table: a run of a subset, as
    # `make test-isa` on another machine, may see smaller worsts)
    problems, loose = [], []
    for precision, tol in PARITY_TOLERANCES.items():
        for key, bound in tol.items():
            kind = how(precision, key)
            err, where, n, paths = worst.get((precision, key), (None, "not measured", 0, {}))
            if err is None:
                loose.append(f"{precision} {key}: no comparison measured it")
                rows.append(f"| {precision} | {key} | {bound:.1e} | {kind} | - | - | - | 0 "
                            "| - |")
                continue
            by_path = " / ".join(f"{paths[p]:.1e}" if p in paths else "-" for p in PATHS)
            ratio = bound / err if err > 0 else (1.0 if bound == 0 else float("inf"))
            if kind == "measured" and not 1.0 <= ratio <= MAX_HEADROOM:
                (problems if ratio < 1.0 else loose).append(
                    f"{precision} {key}: bound {bound:.1e}, worst {err:.2e} "
                    f"({ratio:.2f}x; a measured bound is 1-{MAX_HEADROOM:g}x)")
            if kind != "measured" and ratio < 1.0:
                problems.append(f"{precision} {key}: derived bound {bound:.1e} below the "
                                f"worst measured {err:.2e}")
            rows.append(f"| {precision} | {key} | {bound:.1e} | {kind} | {err:.2e} | "
                        f"{by_path} | {ratio:.3g} | {n} | {where.replace('|', '/')} |")
    return "\n".join(rows), problems, loose


def errors_by_comparison(lines: list[dict]) -> dict[tuple[str, str], list[str]]:
    """(test, class) -> each of its records' errors by check, canonical and sorted."""
    out: dict[tuple[str, str], list[str]] = {}
    for rec in lines:
        errors = {k: err for k, (err, _) in rec["errors"].items()}
        out.setdefault((rec["test"], rec["precision"]), []).append(
            json.dumps(errors, sort_keys=True))
    return {k: sorted(v) for k, v in out.items()}


def same_as(before: list[dict], after: list[dict]) -> list[str]:
    """Where `after`'s comparisons differ from `before`'s (missing ones included)."""
    a, b = errors_by_comparison(before), errors_by_comparison(after)
    diffs = [f"{k[0]} [{k[1]}]: " + ("only before" if k not in b else "only after"
                                     if k not in a else "errors differ")
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    print(f"{len(set(a) | set(b)) - len(diffs)} of {len(set(a) | set(b))} comparisons "
          "carry the same errors")
    return diffs


def rewrite_doc(text: str) -> None:
    doc = DOC.read_text()
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="source", type=Path,
                    help="build the table from this record instead of running the tests")
    ap.add_argument("--keep", type=Path, help="keep the record at this path")
    ap.add_argument("--no-write", action="store_true", help="print only; leave the doc")
    ap.add_argument("--isa", action="append", choices=PATHS,
                    help="kernel path(s) to run (default: every one this CPU has)")
    ap.add_argument("--same-as", type=Path, metavar="BEFORE.jsonl",
                    help="also check every comparison's errors equal this earlier record's")
    args = ap.parse_args(argv)
    failed: list[str] = []
    if args.source is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = args.keep or Path(tmp) / "parity.jsonl"
            path.unlink(missing_ok=True)
            for isa in args.isa or cpu_paths():
                print(f"== the parity tests under ATEN_CPU_CAPABILITY={isa}", flush=True)
                rc = record(path, parity_test_files(), isa, fast_only=args.no_write)
                if rc != 0:
                    failed.append(f"pytest exited {rc} under ATEN_CPU_CAPABILITY={isa}")
            lines = [json.loads(x) for x in path.read_text().splitlines()]
    else:
        lines = [json.loads(x) for x in args.source.read_text().splitlines()]
    text, problems, loose = table(worst_errors(lines))
    if args.no_write:  # checking, not setting, the bounds: a loose bound is a note
        for note in loose:
            print(f"note: {note}")
    else:
        problems += loose
    print(text)
    if not args.no_write:
        rewrite_doc(text)
        print(f"\nwrote {DOC.relative_to(ROOT)}")
    for p in problems:
        print(f"bound breaks its rule: {p}")
    changed = []
    if args.same_as is not None:
        before = [json.loads(x) for x in args.same_as.read_text().splitlines()]
        changed = same_as(before, lines)
        for c in changed:
            print(f"changed: {c}")
    for f in failed:
        print(f"FAILED: {f}")
    return 1 if problems or changed or failed else 0


if __name__ == "__main__":
    sys.exit(main())
