"""Schedule builders: name, pp, micro-batches, virtual stages -> per-rank compute actions.

Each builder returns an unlowered `Schedule` (compute actions only; `lower.py` adds the
transfers). Placement per schedule:
  gpipe, 1f1b, zb-h1, zb-h2   one stage per rank (stage s on rank s)
  interleaved                 v stages per rank, round-robin: stage s on rank s % p
  zb-v, dualpipev             2 stages per rank in a V: rank r holds stages r and 2p-1-r
  dualpipe                    two chains (see ir.py): stage j and stage p+j, rank j and
                              rank p-1-j; micro-batches 0..m/2-1 go down, m/2..m-1 go up
"""

from __future__ import annotations

from plait.parallel.pipeline.ir import Action, Schedule

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe")

# schedules whose placement is fixed at 2 stages per rank
_V_SHAPED = ("zb-v", "dualpipev")


def validate_schedule_request(
    name: str, pp: int, microbatches: int, virtual_stages: int = 1
) -> list[str]:
    """Every problem with the request, each naming the fix; [] when it can be built."""
    p, m, v = pp, microbatches, virtual_stages
    if name not in SCHEDULE_NAMES:
        return [f"schedule={name!r} is unknown; use one of {', '.join(SCHEDULE_NAMES)}"]
    problems = []
    if p < 1:
        problems.append(f"pp={p} must be >= 1")
    if m < 1:
        problems.append(f"microbatches={m} must be >= 1")
    if v < 1:
        problems.append(f"virtual_stages={v} must be >= 1")
    if problems:
        return problems
    if name == "interleaved":
        if v < 2:
            problems.append(
                f"interleaved needs virtual_stages >= 2 (got {v}); use virtual_stages=2, "
                "or schedule=1f1b for one stage per rank"
            )
        if m % p:
            problems.append(
                f"interleaved needs microbatches divisible by pp={p} (got {m}); use "
                f"microbatches={_round_up(m, p)} or another multiple of {p}"
            )
    elif name in _V_SHAPED:
        if v != 2:
            problems.append(
                f"{name} places exactly 2 stages per rank in a V (got virtual_stages={v}); "
                "use virtual_stages=2"
            )
    elif v != 1:
        fix = "use virtual_stages=1"
        if name in ("1f1b", "zb-h1", "zb-h2"):
            fix += ", or schedule=interleaved / zb-v for several stages per rank"
        problems.append(f"{name} places one stage per rank (got virtual_stages={v}); {fix}")
    if name in ("zb-h1", "zb-h2", "zb-v", "dualpipev") and m < p:
        problems.append(f"{name} needs microbatches >= pp={p} (got {m}); use microbatches>={p}")
    if name == "dualpipe":
        if p % 2:
            problems.append(
                f"dualpipe needs an even pp (got {p}); use pp={p + 1} or pp={p - 1}"
                if p > 1
                else "dualpipe needs an even pp >= 2; use pp=2"
            )
        if m % 2:
            problems.append(
                f"dualpipe sends half the micro-batches each way: microbatches must be even "
                f"(got {m}); use microbatches={m + 1}"
            )
        if m < p:
            problems.append(
                f"dualpipe needs microbatches >= pp={p} (got {m}); use microbatches>={p}"
            )
    return problems


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build the named schedule; ValueError listing every problem (and its fix) otherwise."""
    problems = validate_schedule_request(name, pp, microbatches, virtual_stages)
    if problems:
        raise ValueError(f"cannot build schedule {name!r}: " + "; ".join(problems))
    builder = {
        "gpipe": _gpipe,
        "1f1b": _one_f_one_b,
    }[name]
    return builder(pp, microbatches, virtual_stages)


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def _linear(name: str, p: int, m: int, actions: list[list[Action]]) -> Schedule:
    return Schedule(name, p, m, 1, p, list(range(p)), actions)


# --- one stage per rank -------------------------------------------------------------------


def _gpipe(p: int, m: int, v: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019). Peak activations m per rank."""
    acts = [
        [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
        for r in range(p)
    ]
    return _linear("gpipe", p, m, acts)


def _one_f_one_b(p: int, m: int, v: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): rank r runs p-1-r warm-up forwards,
    then alternates one forward, one backward; at most p-r activations alive."""
    acts = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        seq = [Action("F", r, i) for i in range(warm)]
        for k in range(m):
            if warm + k < m:
                seq.append(Action("F", r, warm + k))
            seq.append(Action("B", r, k))
        acts.append(seq)
    return _linear("1f1b", p, m, acts)
