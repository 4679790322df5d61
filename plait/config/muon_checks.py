"""What `train.optimizer='muon'` refuses, each with its fix.

Muon orthogonalises each weight matrix whole (plait/muon.py). Built: every layout whose
ranks hold whole matrices (replicated over data and context parallel, pipeline stages); a
layout that cuts a matrix (ZeRO's flat shards, tensor parallel's slices, expert parallel's
split stacks) needs the matrix gathered where its iteration runs, which is not built yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.config import Config

MUON_SCALES = ("moonlight", "original")  # plait/muon.py update_scale
MUON_NS_DTYPES = ("bf16", "fp32", "fp64")  # the Newton-Schulz iteration's dtypes


def muon_problems(cfg: Config) -> list[str]:
    """The Muon settings' own range, and the layouts Muon is not built for."""
    t, p = cfg.train, cfg.parallel
    checks = [
        (t.muon_scale not in MUON_SCALES,
         f"train.muon_scale={t.muon_scale!r}; use 'moonlight' or 'original'"),
        (t.muon_ns_dtype not in MUON_NS_DTYPES,
         f"train.muon_ns_dtype={t.muon_ns_dtype!r}; use 'bf16', 'fp32' or 'fp64'"),
        (not 0 <= t.muon_momentum < 1,
         f"train.muon_momentum={t.muon_momentum} must be in [0, 1)"),
    ]
    if t.optimizer == "muon":
        checks += [
            (p.zero > 0, f"--optimizer muon with ZeRO-{p.zero} is not built yet (each "
             "matrix's momentum would have to be gathered whole); use --zero 0"),
            (p.tp > 1, f"--optimizer muon with tp={p.tp} is not built yet (tensor "
             "parallel cuts each matrix); use --tp 1"),
            (p.ep > 1, f"--optimizer muon with ep={p.ep} is not built yet (expert "
             "parallel splits the expert stacks); use --ep 1"),
            (p.fault_tolerance, "--optimizer muon with parallel.fault_tolerance is not "
             "built yet; train without --fault-tolerance"),
        ]
    return [problem for broken, problem in checks if broken]
