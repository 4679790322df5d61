"""Run the test suite N times in a row and count failures per test (`make test-repeat N=20`).

A test that fails even once in twenty runs is a bug: use this before every stop that
touches multi-rank code. Each run's junit XML goes to a temporary folder; the table lists
every test that failed or errored at least once, with how many runs it failed in.

  python tests/repeat.py 20 [pytest args...]
  python tests/repeat.py 5 --load 1 tests/test_zero.py   # with one CPU-burning process beside
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def _burn(stop: mp.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _failures(xml_path: Path) -> dict[str, str]:
    """Failed test -> the first lines of its failure message."""
    if not xml_path.exists():
        return {"<no report: the run crashed>": ""}
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            out[f"{case.get('classname')}::{case.get('name')}"] = text
    return out


# what `make test` runs, two files at a time
SUITE = ["tests", "-n", "2", "--dist", "loadfile"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=int)
    ap.add_argument("--load", type=int, default=0,
                    help="CPU-burning processes to run beside the suite (default 0)")
    args, pytest_args = ap.parse_known_args(argv)
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    failed: collections.Counter[str] = collections.Counter()
    red = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(1, args.runs + 1):
                xml = Path(tmp) / f"run{i}.xml"
                t0 = time.monotonic()
                rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p",
                                      "no:cacheprovider", f"--junitxml={xml}",
                                      *(pytest_args or SUITE)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                found = _failures(xml) if rc != 0 else {}
                if rc != 0 and not found:
                    found = {f"<exit code {rc}>": ""}
                red += bool(found)
                failed.update(found.keys())  # one count per failing test and run
                print(f"run {i}/{args.runs}: {'FAILED ' + ', '.join(found) if found else 'ok'}"
                      f" ({time.monotonic() - t0:.0f} s)", flush=True)
                for text in found.values():  # enough to start the hunt
                    print("\n".join(f"    | {line}" for line in text.splitlines()[-30:]))
    finally:
        stop.set()
        for b in burners:
            b.join(timeout=2)
    load = f" (with {args.load} CPU burners beside)" if args.load else ""
    print(f"\n{red} of {args.runs} runs failed{load}")
    for name, n in failed.most_common():
        print(f"  {n:3d} / {args.runs}  {name}")
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
