"""What `plait export` reads: a model's settings and each parameter whole, in plait's
names and row order, from a plait checkpoint, a Hugging Face directory (`hf:DIR`) or a
DCP checkpoint plait exported (`dcp:DIR`, which records the model); and where the
Hugging Face config and tokenizer files come from, if anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from . import dcp, hf
from .format import CheckpointError
from .init_from import checkpoint_model, checkpoint_source
from .reader import full_tensor


class Source:
    """A model to export: `model`, `load(name)` (fp32, whole), `describe`, and `origin`
    (a Hugging Face directory whose config and tokenizer it came from) or
    `tokenizer_json` (the tokenizer a plait run's token file was prepared with)."""

    def __init__(self, source: str):
        self.tokenizer_json: Path | None = None
        self.origin: Path | None = None
        self.describe = source
        directory = hf.hf_dir(source)
        if directory is not None:
            self.model = hf.model_config(directory)
            weights = hf.HFWeights(directory, self.model)
            weights.check()
            self.load: Callable[[str], torch.Tensor] = weights.full
            self.origin = directory
            return
        directory = dcp.dcp_dir(source)
        if directory is not None:
            dcp.read_metadata(directory)
            model = dcp.read_record(directory)
            if model is None:
                raise CheckpointError(
                    f"--from {source}: a DCP checkpoint that records no model (plait's "
                    f"export writes {dcp.MODEL_RECORD}); evaluate or train it with "
                    "--init-from and the model's settings, then export that checkpoint")
            self.model = model
            weights = dcp.DCPWeights(directory, model)
            weights.check()
            self.load = weights.full
            return
        path, meta = checkpoint_source(source)
        self.model = checkpoint_model(meta)
        self.load = lambda n: torch.from_numpy(full_tensor(path, meta, n))
        self.describe = str(path)
        train = meta["config"]["train"]
        self.origin = hf.hf_dir(train.get("init_from"))
        if self.origin is not None and not self.origin.is_dir():
            self.origin = None
        self.tokenizer_json = _run_tokenizer(train.get("data"))


def _run_tokenizer(data: str | None) -> Path | None:
    """The tokenizer.json a plait token file names in its sidecar, if it is there."""
    if not data:
        return None
    side = Path(data).with_suffix(".json")
    try:
        name = json.loads(side.read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str) and (side.parent / name).is_file():
        return side.parent / name
    return None
