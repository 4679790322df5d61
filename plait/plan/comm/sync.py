"""What a measured profile adds to a step's collectives: the waits for the last rank of a
group and the extra after its arrival (plait calibrate's measure_sync; the GPU presets
have neither). `evaluate` adds `sync_seconds` as the step-time line `SYNC_TERM`.
"""

from __future__ import annotations

import numpy as np

from plait.plan.comm import price
from plait.plan.compute import Efficiency, Num

SYNC_TERM = "collective sync (waits)"  # the step-time breakdown's line for sync_seconds


def _power_law(segment: Num, xs: tuple[float, ...], ys: tuple[float, ...]) -> Num:
    """y = y0 (L / L0)^p through the measured points (x > 0; two: exactly, more: least
    squares in log-log, so one noisy point moves the law, not a piece of it); a single
    point, or a y of 0: proportional to L through the largest; 0 where nothing was
    measured. p is held to [0, 1], between a value that does not grow with the compute
    (0) and one proportional to it (1), y0 then refitted: noisy points can say less, or
    more, than either."""
    pts = [(c, w) for c, w in zip(xs, ys, strict=True) if c > 0]
    seg = np.maximum(np.asarray(segment, dtype=float), 0.0)
    if not pts:
        return 0.0 * seg
    if len(pts) == 1 or min(w for _, w in pts) <= 0 or len({c for c, _ in pts}) == 1:
        c1, w1 = max(pts)
        return max(w for _, w in pts) / c1 * seg
    lx, ly = np.log([c for c, _ in pts]), np.log([w for _, w in pts])
    p = float(np.clip(np.polyfit(lx, ly, 1)[0], 0.0, 1.0))
    return np.exp(np.mean(ly - p * lx)) * seg ** p


def desync_wait(segment: Num, eff: Efficiency) -> Num:
    """The mean wait for the last rank of a group at a collective after `segment` seconds
    of compute on each rank since their last one: a power law (`_power_law`) through the
    profile's measured points (independent disturbances would give p = 1/2)."""
    return _power_law(segment, eff.desync_compute, eff.desync_wait)


def sync_after(segment: Num, eff: Efficiency) -> Num:
    """The mean seconds a blocking collective takes past its alpha-beta price once the
    last rank has arrived, after `segment` seconds of compute: the profile's per-segment
    measurements through the same power law (measured here: it grows with the compute
    before the call; heavy-tailed, so a mean over every call: docs/planner_cpu.md), or its
    one mean `sync_extra` where those are not in the profile."""
    if len(eff.sync_after) != len(eff.desync_compute) or not eff.sync_after:
        return eff.sync_extra + 0.0 * np.asarray(segment, dtype=float)
    return _power_law(segment, eff.desync_compute, eff.sync_after)


def blocking_calls(colls: list[price.Collective],
                   bytes_cap: float = float("inf")) -> tuple[Num, Num]:
    """(calls, their bytes, each call's held at `bytes_cap`) a step the rank waits on at
    once, over groups of more than one rank: every listed call but the pipeline's sends
    (the simulated timeline holds them) and those a collective says overlap compute
    (`Collective.blocking`: ZeRO's prefetched gathers, reduce-scatters completed behind
    later layers)."""
    calls, nbytes = 0.0, 0.0
    for c in colls:
        if c.dim != "pp" or not c.op.startswith("send"):
            n = np.where(np.asarray(c.group) > 1, c.count if c.blocking is None
                         else c.blocking, 0.0)
            calls, nbytes = calls + n, nbytes + n * np.minimum(c.size, bytes_cap)
    return np.asarray(calls, dtype=float), np.asarray(nbytes, dtype=float)


def sync_seconds(eff: Efficiency, colls: list[price.Collective], compute: Num) -> Num:
    """Seconds a step's synchronising collectives cost beyond their alpha-beta time: each
    of the K blocking calls per step (`blocking_calls`) waits for the last rank after its
    share of the step's compute, L = compute / K (the ranks' jitter), and then pays the
    measured extra after that arrival at that L, and sync_per_byte for each byte of its
    message up to the largest size measured (plait calibrate's measure_sync; held beyond
    it: the closed loop's tp 2 calls of 2 KB and 1 MB paid the same extra,
    1.4-2.1 ms, where the line from 1 to 128 KiB gave the 1 MB ones 6 ms more)."""
    calls, nbytes = blocking_calls(colls, eff.sync_bytes_measured)
    segment = np.asarray(compute, dtype=float) / np.maximum(calls, 1.0)
    return calls * (sync_after(segment, eff) + desync_wait(segment, eff)) \
        + eff.sync_per_byte * nbytes
