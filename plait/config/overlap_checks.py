"""What `parallel.overlap_fb` (the overlapped F&B executor,
plait/parallel/pipeline/fb_overlap.py) refuses, each with its fix.

Built: dualpipe and dualpipev, MoE (expert parallel's all-to-alls interleaved) and dense
models, data parallel, ZeRO-1. Not built yet: the combinations below, whose collectives
or recomputed forwards run inside a pair's pieces in ways the executor does not order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.dims import DIMENSIONS

if TYPE_CHECKING:
    from plait.config import Config

PAIRING_SCHEDULES = ("dualpipe", "dualpipev")  # their steady phase is F&B pairs
# what a dimension's ranks divide, where the executor is built for it (the others' layers
# run collectives inside a pair's pieces that it does not order yet)
BUILT_SPLITS = ("batch", "layers", "experts")


def overlap_fb_problems(cfg: Config) -> list[str]:
    """The layouts `--overlap-fb` is not built for (none when it is off)."""
    p, t = cfg.parallel, cfg.train
    if not p.overlap_fb:
        return []
    checks = [
        (p.schedule not in PAIRING_SCHEDULES,
         f"--overlap-fb overlaps DualPipe's F&B pairs; parallel.schedule={p.schedule!r} "
         "has none: use --schedule dualpipev or dualpipe, or drop --overlap-fb"),
        *((getattr(p, d.name) > 1, f"--overlap-fb with {d.name}={getattr(p, d.name)} is "
           f"not built yet; use --{d.name.replace('_', '-')} 1")
          for d in DIMENSIONS if d.splits not in BUILT_SPLITS),
        (p.zero > 1, f"--overlap-fb with zero={p.zero} is not built yet; use --zero 0 "
         "or 1"),
        (t.recompute != "none", f"--overlap-fb with train.recompute={t.recompute!r} is "
         "not built yet; use --recompute none"),
        (t.compile, "--overlap-fb with train.compile is not built yet; drop --compile"),
        (p.optimizer_sync != "barrier", "--overlap-fb with optimizer_sync="
         f"{p.optimizer_sync} is not built yet; use optimizer_sync=barrier"),
        (p.ep_dispatch != "assignment", f"--overlap-fb with parallel.ep_dispatch="
         f"{p.ep_dispatch!r} is not built yet; use ep_dispatch=assignment"),
    ]
    return [problem for broken, problem in checks if broken]
