"""What `train.optimizer='muon'` refuses, each with its fix.

Muon orthogonalises each weight matrix whole (plait/muon.py). Built: replicated over data
and context parallel, pipeline stages, expert parallel (each rank's experts whole), tensor
parallel (slices joined on an owner: plait/parallel/muon_tp.py) and ZeRO 1, 2, 3 (pieces
gathered on an owner: plait/parallel/muon.py). Not built yet: the combinations below.
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
            (p.tp > 1 and p.zero > 0, f"--optimizer muon with tp={p.tp} and ZeRO-{p.zero} is "
             "not built yet (ZeRO's shards of tensor-parallel slices); use --zero 0"),
            (p.tp > 1 and cfg.model.n_experts > 0, "--optimizer muon with tensor parallel "
             "experts is not built yet; use --tp 1"),
            (p.tp > 1 and cfg.model.n_kv_heads < p.tp, "--optimizer muon with tp="
             f"{p.tp} above the model's {cfg.model.n_kv_heads} key/value heads is not built "
             "yet (the K/V slices repeat); use a tp dividing the key/value heads"),
            (p.fault_tolerance, "--optimizer muon with parallel.fault_tolerance is not "
             "built yet; train without --fault-tolerance"),
            (p.zero > 0 and p.dp_replicate > 1, "--optimizer muon with hybrid sharding "
             f"(dp_replicate={p.dp_replicate}) is not built yet; use --dp-replicate 1"),
            (p.zero > 0 and p.optimizer_sync == "post_validation", "--optimizer muon with "
             "ZeRO and --optimizer-sync post_validation is not built yet (the rollback "
             "would not restore the momentum); use --optimizer-sync barrier"),
            (p.zero > 0 and t.precision == "fp8", "--optimizer muon with ZeRO and "
             "--precision fp8 is not built yet; use --precision bf16"),
        ]
    return [problem for broken, problem in checks if broken]
