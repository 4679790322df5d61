"""The recomputation settings' names, standard library only: config validation reads them
without importing torch (the policy itself is plait/model/recompute.py)."""

from __future__ import annotations

MODES = ("none", "selective", "full")
# operator groups (plait/model/recompute.py's OP_GROUPS: every aten operator is in one)
GROUPS = ("matmul", "attention", "elementwise")
# selective's default: recompute these, save the matmul outputs (docs/recompute.md)
DEFAULT_OPS = ("attention", "elementwise")


def ops_problems(ops: tuple[str, ...]) -> list[str]:
    """What is wrong with a `train.recompute_ops` value (empty: nothing)."""
    unknown = [o for o in ops if o not in GROUPS]
    if unknown:
        return [f"train.recompute_ops names {', '.join(map(repr, unknown))}; use groups "
                f"of {', '.join(GROUPS)} (default {','.join(DEFAULT_OPS)})"]
    if "elementwise" not in ops:
        return [f"train.recompute_ops={','.join(ops) or '(empty)'} saves the element-wise "
                "ops (norms, RoPE, collectives): more memory than no recomputation, and "
                "an in-place collective's saved output is wrong on the re-run; include "
                "'elementwise', e.g. train.recompute_ops=attention,elementwise"]
    return []
