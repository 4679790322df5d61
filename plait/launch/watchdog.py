"""No silent hangs: a watchdog thread in every rank, and a report that
names the rank that is behind and the collective the others wait in.

Every collective goes through plait/comm, which notes it in the ledger's flight recorder
as it is entered (`Ledger.enter`: op, mesh dim, payload, step, tag, this rank's sequence
number overall and on that dim) and marks it done when it completes. The watchdog, a
daemon thread of each rank:

- publishes its rank's flight recorder to the job's store every `interval` seconds and
  after every step (one small `set`), so that a rank that stops (SIGSTOP, a stuck kernel,
  an endless loop) has left its last state behind; after a step, with that step's compute
  and wait seconds and the straggler verdict (plait/train/stragglers.py);
- when a collective of its own rank has been in flight for `timeout` seconds, publishes
  once more and reports: the first rank to do so (an atomic `add` on the store) reads
  every rank's state and prints one line naming the rank(s) behind (the lowest sequence
  number on the dim of the collective the others wait in, or no state at all), then one
  line per rank with its last collective (in flight or done, how long ago it reported,
  its last step's compute and wait), the last straggler verdict published, and its rank
  exits 1; torch's agent then stops every other rank.

The process group's own timeout is set `REPORT_MARGIN_S` later than the watchdog's, so
the report comes first. This is the CLI layer: it ends the process (`os._exit`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from plait.launch.local import job_store
from plait.ledger import FlightEntry, Ledger
from plait.train.stragglers import straggler_text

REPORT_MARGIN_S = 30.0  # the process group times out this much after the watchdog
KEY = "plait-flight"


def _entry_text(e: dict) -> str:
    state = "in flight" if not e["done"] else "done"
    tag = f", {e['tag']}" if e["tag"] else ""
    return (f"{e['op']}@{e['dim']} #{e['dim_seq']} (step {e['step']}, {e['payload']:,} B"
            f"{tag}) {state}")


def hang_report(states: dict[int, dict | None], world: int, reporter: int,
                timeout_s: float) -> list[str]:
    """The lines of a hang report from every rank's published state (None: none came).
    A state: {"entries": [FlightEntry as dict, ...], "at": wall time published}."""
    last = {r: (s["entries"][-1] if s and s["entries"] else None) for r, s in states.items()}
    stuck = last[reporter]  # the collective the reporter waits in
    dim = stuck["dim"] if stuck else None

    def progress(r: int) -> int:  # how far rank r got on that dim
        entries = (states.get(r) or {}).get("entries", [])
        return max([e["dim_seq"] for e in entries if e["dim"] == dim], default=-1)

    waiting = [r for r in range(world) if last.get(r) and not last[r]["done"]]
    silent = [r for r in range(world) if states.get(r) is None]
    seen = [r for r in range(world) if states.get(r) is not None]
    low = min((progress(r) for r in seen), default=-1)
    behind = sorted({*silent, *(r for r in seen if progress(r) == low
                                and low < max(progress(q) for q in seen))})
    mismatched = mismatches(states)
    lines = [f"plait: hang: rank {reporter} waited {timeout_s:.0f} s in "
             f"{_entry_text(stuck) if stuck else 'a collective'}; "
             + (f"behind: rank{'s' * (len(behind) > 1)} {', '.join(map(str, behind))}"
                if behind else "no rank is behind on that dim"
                + (" (a mismatched collective?)" if not mismatched else ""))
             + f"; waiting: {', '.join(map(str, waiting)) or 'none'}. Last collective per rank "
             "(the flight recorder):"]
    return lines + rank_lines(states, world) + straggler_lines(states) + mismatched


def failure_report(states: dict[int, dict | None], world: int, reporter: int) -> list[str]:
    """The lines a failed rank prints (a peer gone, gloo's error, an exception): where it
    was, and every rank's last collective as published (module doc)."""
    entries = (states.get(reporter) or {}).get("entries", [])
    open_ = [e for e in entries if not e["done"]]
    where = (f"in {_entry_text(open_[0])}" if open_ else
             f"after {_entry_text(entries[-1])}" if entries else "before its first collective")
    return ([f"plait: rank {reporter} failed {where}. Last collective per rank (the flight "
             "recorder):"] + rank_lines(states, world) + straggler_lines(states)
            + mismatches(states))


def rank_lines(states: dict[int, dict | None], world: int) -> list[str]:
    """One line per rank: its last collective (in flight or done), and how long ago it
    published that."""
    now, lines = time.time(), []
    for r in range(world):
        s = states.get(r)
        if s is None:
            lines.append(f"  rank {r}: no state published (stopped before its first report)")
            continue
        what = _entry_text(s["entries"][-1]) if s["entries"] else "no collective yet"
        step = s.get("step")
        figures = (f"; step {step['step']}: compute {step['compute_s'] * 1e3:.1f} ms, wait "
                   f"{step['wait_s'] * 1e3:.1f} ms" if step and "compute_s" in step else "")
        lines.append(f"  rank {r}: {what}; reported {now - s['at']:.1f} s ago{figures}")
    return lines


def straggler_lines(states: dict[int, dict | None]) -> list[str]:
    """The straggler verdict of the newest step any rank published (every rank reaches
    the same one; none where no rank has published a step)."""
    steps = [s["step"] for s in states.values() if s and s.get("step")]
    if not steps:
        return []
    last = max(steps, key=lambda x: x["step"])
    verdict = last.get("straggler")  # on the step before (the exchange runs behind)
    if verdict:
        return [f"  stragglers at step {verdict['step']}: {straggler_text(verdict)}"]
    return [f"  stragglers: none named (the verdict published after step {last['step']})"]


def mismatches(states: dict[int, dict | None]) -> list[str]:
    """Collectives that ranks entered as the same call on a dim (the same `dim_seq`) but
    that differ in op, payload or tag: the ranks' code paths went out of step there (a
    rank skipped a collective, or issued one the others did not)."""
    calls: dict[tuple[str, int], dict[int, dict]] = {}
    for r, s in sorted(states.items()):
        for e in (s or {}).get("entries", []):
            calls.setdefault((e["dim"], e["dim_seq"]), {})[r] = e
    lines = []
    for (dim, seq), by_rank in sorted(calls.items(), key=lambda kv: kv[0][1]):
        kinds = {(e["op"], e["payload"], e["tag"]) for e in by_rank.values()}
        if len(kinds) > 1:
            said = "; ".join(f"rank {r}: {e['op']} {e['payload']:,} B ({e['tag'] or 'untagged'}"
                             f", step {e['step']})" for r, e in sorted(by_rank.items()))
            lines.append(f"  mismatch on {dim} call #{seq}: {said}")
    return lines[:1]  # the first one: every later call on that dim is out of step too


class Watchdog:
    """The thread of one rank (module doc). `store`: a client of the job's store;
    `exit`: what ends the rank after a report (os._exit by default)."""

    def __init__(self, ledger: Ledger, rank: int, world: int, store: dist.Store,
                 timeout_s: float, interval_s: float | None = None,
                 exit: Callable[[int], None] = os._exit):
        self.ledger, self.rank, self.world, self.store = ledger, rank, world, store
        self.timeout_s = timeout_s
        self.interval_s = interval_s or min(1.0, timeout_s / 10)
        self._exit, self._stop = exit, threading.Event()
        self._step: dict | None = None  # the last step's figures (`publish`)
        self.thread = threading.Thread(target=self._run, name="plait-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def publish(self, row: dict | None = None) -> None:
        """Publish now (the rank entry calls it after each step, with its row: a rank that
        stops right after one has left its whole state, and its step's figures)."""
        if row is not None:
            self._step = {k: row[k] for k in ("step", "compute_s", "wait_s", "straggler")
                          if k in row}
        self._publish(self.ledger.in_flight())

    def _publish(self, entries: list[FlightEntry]) -> None:
        state = {"entries": [e.__dict__ for e in entries], "at": time.time(),
                 "step": self._step}
        with contextlib.suppress(Exception):  # the store's host gone: the job is ending
            self.store.set(f"{KEY}/{self.rank}", json.dumps(state))

    def report_failure(self) -> None:
        """This rank failed (the rank entry calls it): publish its state and, if no rank
        has reported yet, print every rank's flight recorder (`failure_report`)."""
        self.stop()
        self.publish()
        try:
            first = self.store.add(f"{KEY}/reporters", 1) == 1
        except Exception:  # noqa: BLE001 - no store: this rank's own view
            first = True
        if first:
            states = {r: self._state(r) for r in range(self.world)}
            states[self.rank] = states[self.rank] or {"entries": [
                e.__dict__ for e in self.ledger.in_flight()], "at": time.time(),
                "step": self._step}
            print("\n".join(failure_report(states, self.world, self.rank)), file=sys.stderr,
                  flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            entries = self.ledger.in_flight()
            self._publish(entries)
            open_ = [e for e in entries if not e.done]
            if open_ and time.perf_counter() - open_[0].entered > self.timeout_s:
                if not self._stop.is_set():
                    self._report()
                return

    def _report(self) -> None:
        try:
            first = self.store.add(f"{KEY}/reporters", 1) == 1
        except Exception:  # noqa: BLE001 - no store: report what this rank knows
            first = True
        if first:
            states = {r: self._state(r) for r in range(self.world)}
            states[self.rank] = states[self.rank] or {"entries": [
                e.__dict__ for e in self.ledger.in_flight()], "at": time.time(),
                "step": self._step}
            print("\n".join(hang_report(states, self.world, self.rank, self.timeout_s)),
                  file=sys.stderr, flush=True)
        else:  # another rank reports; leave it the time to, then end anyway
            time.sleep(REPORT_MARGIN_S / 3)
        self._exit(1)

    def _state(self, rank: int) -> dict | None:
        key = f"{KEY}/{rank}"
        with contextlib.suppress(Exception):
            if self.store.check([key]):
                return json.loads(self.store.get(key))
        return None


def store_client(timeout_s: float) -> dist.Store | None:
    """A client of the job's store for the watchdog's thread: the launcher's
    (plait.launch.local.job_store), else MASTER_ADDR:MASTER_PORT (torchrun run directly); its
    keys under the restart count (torchrun's own restarts may keep the store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = job_store(timeout)
    if store is not None:
        return store
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            store)
