"""Checks on a schedule: placeholder, completed below."""

from __future__ import annotations

from plait.parallel.pipeline.ir import Schedule


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the most stage-micro-batch activation sets alive at once: +1 when an F
    runs, -1 when the matching I or B finishes."""
    peaks = []
    for acts in schedule.actions:
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind in ("I", "B"):
                live -= 1
        peaks.append(peak)
    return peaks
