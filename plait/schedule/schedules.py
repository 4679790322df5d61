"""Schedule builders: name, pp, micro-batches, virtual stages -> per-rank compute actions.

Each builder takes (p, m, v) (the list-scheduled ones also `durations`) and returns an
unlowered `Schedule` (compute actions only; `lower.py` adds the transfers). A builder
trusts its request: call `registry.build_schedule`, which checks it first (the registry,
registry.py, holds every other fact about each schedule). Placement per schedule:
  gpipe, 1f1b, zb-h1, zb-h2   one stage per rank (stage s on rank s)
  interleaved                 v stages per rank, round-robin: stage s on rank s % p
  zb-v, dualpipev             2 stages per rank in a V: rank r holds stages r and 2p-1-r
  dualpipe                    two chains (see ir.py): stage j and stage p+j, rank j and
                              rank p-1-j; micro-batches 0..m/2-1 go down, m/2..m-1 go up
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import add

from plait.schedule.ir import Action, Schedule
from plait.schedule.ir import trusted as _act
from plait.schedule.list_schedule import list_schedule
from plait.schedule.simulate import Durations


def _linear(name: str, p: int, m: int, actions: list[list[Action]]) -> Schedule:
    return Schedule(name, p, m, 1, p, list(range(p)), actions)


# --- one stage per rank -------------------------------------------------------------------


def build_gpipe(p: int, m: int, v: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019). Peak activations m per rank."""
    acts = [
        [_act("F", r, i) for i in range(m)] + [_act("B", r, i) for i in range(m)]
        for r in range(p)
    ]
    return _linear("gpipe", p, m, acts)


def build_1f1b(p: int, m: int, v: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): rank r runs p-1-r warm-up forwards,
    then alternates one forward, one backward; at most p-r activations alive."""
    acts = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        seq = [_act("F", r, i) for i in range(warm)]
        for k in range(m):
            if warm + k < m:
                seq.append(_act("F", r, warm + k))
            seq.append(_act("B", r, k))
        acts.append(seq)
    return _linear("1f1b", p, m, acts)


def build_zb_h1(p: int, m: int, v: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, section 2.1): 1F1B with B split into I and W, and rank r
    deferring its W's by r micro-batches. The I chain no longer waits for W's, so the
    bubble shrinks to (p-1)(T_F+T_I-T_W) while activations stay at 1F1B's p-r (the r
    deferred W's hold only weight-gradient inputs)."""
    return _split_1f1b("zb-h1", p, m, warm=lambda r: p - 1 - r, w_delay=lambda r: r)


def build_zb_h2(p: int, m: int, v: int) -> Schedule:
    """ZB-H2 (Qi et al. 2023, section 2.2): 2(p-1-r) warm-up forwards fill the time until
    the first gradient returns, and W's are deferred by 2r micro-batches to fill the tail.
    Rank 0 holds up to 2p-1 activations. Every rank then works without a gap from its first
    action to its last (a parallelogram) when m >= 2p-1 and 2 T_W <= T_F + T_I."""
    return _split_1f1b("zb-h2", p, m, warm=lambda r: 2 * (p - 1 - r), w_delay=lambda r: 2 * r)


def _split_1f1b(name: str, p: int, m: int, warm, w_delay) -> Schedule:
    """Warm-up forwards, then per micro-batch k: F (next), I k, W (k - delay)."""
    acts = []
    for r in range(p):
        w = min(warm(r), m)
        seq = [_act("F", r, i) for i in range(w)]
        next_w = 0
        for k in range(m):
            if w + k < m:
                seq.append(_act("F", r, w + k))
            seq.append(_act("I", r, k))
            if k >= w_delay(r):
                seq.append(_act("W", r, next_w))
                next_w += 1
        seq += [_act("W", r, i) for i in range(next_w, m)]
        acts.append(seq)
    return _linear(name, p, m, acts)


# --- several stages per rank --------------------------------------------------------------


def build_interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2), Megatron-LM's order: stage s on
    rank s % p; forwards go in rounds of p micro-batches per chunk (chunk 0 for mb 0..p-1,
    chunk 1 for the same mbs, ..., then mb p..2p-1), backwards in the same rounds with the
    chunks reversed; rank r warms up with 2(p-1-r) + (v-1)p forwards. Bubble time
    (p-1)(T_F+T_B) in per-stage times: 1/v of 1F1B's."""
    total = m * v  # stage-microbatch forwards per rank
    mbs = [(k // (p * v)) * p + k % p for k in range(total)]  # the k-th forward's (backward's)
    chunk = [(k // p) % v for k in range(total)]  # ... chunk, the same on every rank
    f_stage0 = [c * p for c in chunk]  # stage on rank 0; rank r adds r
    b_stage0 = [(v - 1 - c) * p for c in chunk]
    acts = []
    for r in range(p):  # each rank's lists made by C builtins, no Python step per action
        fwd = _actions("F", map(add, f_stage0, repeat(r)), mbs)
        bwd = _actions("B", map(add, b_stage0, repeat(r)), mbs)
        warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
        acts.append(fwd[:warm] + list(chain.from_iterable(zip(fwd[warm:], bwd)))
                    + bwd[total - warm:])
    return Schedule("interleaved", p, m, v, p * v, [s % p for s in range(p * v)], acts)


def _actions(kind: str, stages, mbs) -> list[Action]:
    """Actions (kind, stage, mb) for the stages and micro-batches given, made in C."""
    return list(map(tuple.__new__, repeat(Action), zip(repeat(kind), stages, mbs,
                                                         repeat(None))))


def _v_placement(p: int) -> list[int]:
    """Rank r holds stages r and 2p-1-r: the model goes down the ranks and back up."""
    return list(range(p)) + list(range(p - 1, -1, -1))


def build_zb_v(p: int, m: int, v: int, durations: Durations | None = None,
               layout: list | None = None) -> Schedule:
    """ZB-V (Qi et al. 2023, section 6): V placement, B split into I/W, at most 2p stage
    activations per rank (= 1F1B's peak p, as each stage is half a rank's layers),
    counted from F to W as the paper counts them: a W still holds nearly all of them
    (its matmuls' inputs and output gradients). The order comes from the list scheduler
    (list_schedule.py), run with `durations` (default T_F = T_I = T_W): with room full,
    each (stage, micro-batch) runs F, I, W back to back, the paper's pattern. With equal
    durations and m >= 2p: exactly 2p per rank, a synchronous bubble of (p-1) T_F per
    rank, and up to p = 4 no rank idle between its first and last action (from p = 5 one
    rank idles one T_F in its cool-down; tests/test_schedules.py)."""
    # both stages of a rank count against 2p. The way down (stage r) keeps the last unit
    # of room for activations sure to be freed ("sure"), and runs at most 2(p-1-r)+1 F's
    # ahead of the way up on its rank (the paper's warm-up, where the first micro-batch
    # comes back): without these, rank r full of micro-batches going down could wait for
    # room its way up needs to bring their gradients back (a deadlock), or, with slower
    # backwards, fill its room with them before the way up gets any (a bubble)
    return list_schedule(
        "zb-v",
        p,
        m,
        2,
        _v_placement(p),
        1,
        lambda s: (min(s, 2 * p - 1 - s), 2 * p, "sure" if s < p else "room"),
        durations,
        layout,
        freed_by="W",
        lead=lambda s: (2 * p - 1 - s, 2 * (p - 1 - s) + 1) if s < p else None,
    )


def build_dualpipe(p: int, m: int, v: int, durations: Durations | None = None,
                   layout: list | None = None) -> Schedule:
    """DualPipe (DeepSeek-V3 technical report, 2024, section 3.2.1): two chains over two
    copies of the model, micro-batches 0..m/2-1 enter at rank 0, m/2..m-1 at rank p-1, so
    each end's warm-up fills the other's bubble. Order from the list scheduler with at most
    p+1 activations per rank (the report's Table 2)."""
    placement = list(range(p)) + list(range(p - 1, -1, -1))
    # a 1F1B-like quota per chain: p - j micro-batches on the stage computing block j, so
    # rank r holds (p - r) + (r + 1) = p + 1; separate quotas keep the chains from
    # blocking each other
    return list_schedule(
        "dualpipe", p, m, 1, placement, 2, lambda s: (s, p - s % p, "room"), durations, layout
    )


def build_dualpipev(p: int, m: int, v: int) -> Schedule:
    """DualPipeV, DualPipe "cut in half" onto a V (rank r: chunk 0 = stage r, chunk 1 =
    stage 2p-1-r), written from DualPipe's published phase structure. Per rank:
      1. 2(p-1-r) forwards of chunk 0            5. p-1-r x (B chunk 1, F 1, B 0)
      2. r+1 x (F 0, F 1)                          6. r+1 x (B 1, B 0); the later half split
      3. p-1-r x (I 1, W 1, F 1)                      into I + deferred W
      4. m-2p+r+1 x (F 0, B 1, F 1, B 0)           7. p-1-r x (W, I 0)
         (DualPipe overlaps each F with the B    8. the remaining W's
         beside it; this model runs them in turn)
    Needs m >= 2p-1 so that phase 4 is not negative on rank 0."""
    acts = []
    for r in range(p):  # each phase a zip of slices: C builtins, no Python step per action
        stage = (r, 2 * p - 1 - r)
        at = {"F": [0, 0], "B": [0, 0]}  # the next micro-batch of each chunk's F, backward

        def take(kind: str, c: int, n: int, stage=stage, at=at) -> list[Action]:
            """The next n of kind on chunk c (its count is advanced by `run`)."""
            lo = at["F" if kind == "F" else "B"][c]
            return _actions(kind, repeat(stage[c]), range(lo, lo + n))

        def run(*parts: tuple[str, int], n: int, at=at) -> list[Action]:
            """n rounds of the parts in turn, e.g. run(("F", 0), ("B", 1), n=3)."""
            cols = [take(kind, c, n) for kind, c in parts]
            for kind, c in parts:
                at["F" if kind == "F" else "B"][c] += n if kind != "W" else 0
            return list(chain.from_iterable(zip(*cols)))

        k = p - 1 - r
        seq = run(("F", 0), n=2 * k) + run(("F", 0), ("F", 1), n=r + 1)
        seq += run(("I", 1), ("W", 1), ("F", 1), n=k)  # each W right after its I
        seq += run(("F", 0), ("B", 1), ("F", 1), ("B", 0), n=max(m - 2 * p + r + 1, 0))
        seq += run(("B", 1), ("F", 1), ("B", 0), n=k)
        whole = (r + 1) // 2  # of the r+1 (B 1, B 0) pairs, the later ones are split
        seq += run(("B", 1), ("B", 0), n=whole)
        split = r + 1 - whole
        pending = list(chain.from_iterable(zip(take("W", 1, split), take("W", 0, split))))
        seq += run(("I", 1), ("I", 0), n=split)
        # then p-1-r x (the oldest deferred W, I 0, whose W is deferred in turn): split >= 1
        queue = pending + take("W", 0, k)
        seq += list(chain.from_iterable(zip(queue[:k], take("I", 0, k)))) + queue[k:]
        at["B"][0] += k
        acts.append(seq)
    return Schedule("dualpipev", p, m, 2, 2 * p, _v_placement(p), acts)
