"""What `train.compile` (plait/parallel/compile.py) refuses, each with its fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.schedule.registry import SCHEDULES

if TYPE_CHECKING:
    from plait.config import Config

# train.compile_backend: inductor generates fused kernels; aot_eager and eager trace only
# (a compiled run's graphs, breaks and autograd without code generation)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def compile_problems(cfg: Config) -> list[str]:
    p, t = cfg.parallel, cfg.train
    if t.compile_backend not in COMPILE_BACKENDS:
        return [f"train.compile_backend={t.compile_backend!r}; use one of "
                f"{', '.join(COMPILE_BACKENDS)}"]
    if not t.compile:
        return []
    spec = SCHEDULES.get(p.schedule)
    if p.pp > 1 and spec is not None and spec.split_backward:
        splits = ", ".join(n for n, s in SCHEDULES.items() if not s.split_backward)
        return [f"--compile with schedule {p.schedule!r}: its backward is split into input "
                "and weight gradients, each linear's weight gradient a separate autograd "
                "pass, but a compiled block is one autograd node; use a schedule that does "
                f"not split it ({splits}) or drop --compile"]
    return []
