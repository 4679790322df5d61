"""`plait export ... --to dcp:OUT [--dcp-names 2026|2025]` (plait/checkpoint/interop.py):
a torch.distributed.checkpoint directory with torchtitan's names (docs/interop.md), today's
(2026) unless asked for the older ones (plait/checkpoint/titan_names.py): Llama, and
DeepSeek-V3's MLA and MoE, its stacked experts one tensor each as torchtitan holds them.

Written by DCP itself (`torch.distributed.checkpoint.save`, `FileSystemWriter`, one
file), so torchtitan (`checkpoint.initial_load_path` with `initial_load_model_only`),
FSDP2 or any DCP reader loads it at any world size; one process, no process group
(`no_dist`). The save planner (`_LazySavePlanner`) plans from shapes alone (meta tensors)
and fetches each tensor from the source only when DCP's writer asks for it: one tensor
in memory at a time, as the safetensors export. Beside DCP's files, `plait_model.json`
records the model (DCP has no place for settings); DCP readers ignore it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import dcp
from .export import DTYPES
from .format import CheckpointError
from .source import Source


def _lazy_save_planner(load, dtype: torch.dtype):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _LazySavePlanner(DefaultSavePlanner):
        """Resolves each write item from the source when the writer reaches it."""

        def resolve_data(self, write_item) -> torch.Tensor:
            name = write_item.index.fqn
            t = load(name).to(dtype).contiguous()
            want = tuple(self.state_dict[name].shape)
            if tuple(t.shape) != want:
                raise CheckpointError(f"{name}: got shape {tuple(t.shape)}, expected {want}")
            return t

    return _LazySavePlanner()


def write_dcp(src: Source, out: Path, dtype: str, naming: str = dcp.DEFAULT_NAMING) -> int:
    """`src` as a DCP checkpoint with torchtitan's names of `naming` in `out` (an empty
    directory); returns the tensors written."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    tdtype = DTYPES[dtype][0]
    names = dcp.export_names(src.model, naming)
    shapes = {theirs: torch.empty(shape, dtype=tdtype, device="meta")
              for theirs, (_, shape) in names.items()}
    with dcp.quiet_dcp():
        dcp_save(shapes, storage_writer=FileSystemWriter(str(out), thread_count=1),
                 planner=_lazy_save_planner(lambda t: src.load(names[t][0]), tdtype),
                 no_dist=True)
    dcp.write_record(out, src.model)
    return len(names)
