"""torch.distributed.checkpoint (DCP) directories with torchtitan's names, in
(docs/interop.md): `--init-from dcp:DIR`.

Names: plait/checkpoint/titan_names.py's table, torchtitan's Llama 3 and DeepSeek-V3
(MLA, MoE) names in its two namings (2026: `layers.N.attention.qkv_linear.wq.weight`,
`lm_head.weight`, `moe.routed_experts.inner_experts.w1_EFD`; 2025: `attention.wq.weight`,
`output.weight`, `moe.experts.w1`). A checkpoint's naming is detected from its names
(`DCPWeights.naming`, said by `describe`). Shapes and row order are plait's in both.
The names may sit under a prefix (a checkpoint that saved `{"model": state_dict}` holds
`model.tok_embeddings.weight`); optimizer, data loader and train-state entries beside
them are ignored.

A DCP checkpoint records no model settings. plait's own export adds `plait_model.json`
(its ModelConfig) beside DCP's files; without it the run's model settings (--model,
--config, --set) describe the model, and `check` compares every shape with DCP's
metadata, naming the settings that would make them agree.

Reading: after `parallelize`, each rank lists the rectangles covering what it holds
(`pieces.covering_box`: its tensor-parallel box, its expert-parallel rows of a stacked
expert weight, the rows around a ZeRO flat run) and hands them to DCP's loader as one
state dict of plain buffers, one per tensor, with a load planner (`BoxPlanner`) that
places each at its offset in the global tensor: DCP's own
`create_read_items_for_chunk_list` then intersects them with the saved chunks, as it
does for a DTensor's local shard, so a rank reads its experts, never the whole stack.
`no_dist=True`: no collective, every rank plans and reads alone (as with `hf:`); DCP
reads each saved chunk that overlaps and narrows it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from plait.mesh import ParallelMesh
from plait.model.presets import ModelConfig
from plait.parallel.parallelize import ParallelModel

from . import hf
from .format import CheckpointError
from .pieces import Piece, covering_box, cut, initial_pieces
from .titan_names import DEFAULT_NAMING, detect, head_name, is_ignored, marks, names

DCP_PREFIX = "dcp:"
MODEL_RECORD = "plait_model.json"  # plait's ModelConfig, beside DCP's own files
RECORD_FORMAT = "plait-dcp-model/1"
DCP_METADATA = ".metadata"  # DCP's FileSystemWriter names its metadata file so
# keys a torchtitan model checkpoint holds beside the weights: left alone
MODEL_ROOTS = ("tok_embeddings.", "layers.", "norm.", "output.", "lm_head.")


class DCPError(CheckpointError):
    """A DCP directory plait cannot read; the message names why and the fix."""


def dcp_dir(source: str | None) -> Path | None:
    """The directory of a `dcp:DIR` source, None for anything else."""
    return hf.source_dir(source, DCP_PREFIX)


def titan_names(m: ModelConfig, naming: str = DEFAULT_NAMING
                ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """plait name -> (torchtitan name in `naming`, shape), in the model's order. A tied
    model has no `head.weight`: torchtitan has no tying, so an export writes the head as
    a copy of the embedding (`export_names`)."""
    return names(m, naming)


def export_names(m: ModelConfig, naming: str = DEFAULT_NAMING
                 ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """torchtitan name -> (the plait tensor that fills it, shape): every tensor of the
    torchtitan model, the head from the embedding where plait ties them."""
    out = {theirs: (ours, shape) for ours, (theirs, shape) in titan_names(m, naming).items()}
    if m.tie_embeddings:
        out[head_name(naming)] = ("embed.weight", (m.vocab_size, m.dim))
    return out


def read_record(directory: Path) -> ModelConfig | None:
    """The model plait's export recorded beside the checkpoint (None: none recorded)."""
    path = Path(directory) / MODEL_RECORD
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["format"] == RECORD_FORMAT
        saved = dict(data["model"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise DCPError(f"{path}: not a plait model record ({e!r}); delete it to take the "
                       "model from the run's settings") from None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise DCPError(f"{path}: model fields this plait does not know ({', '.join(unknown)})")
    return ModelConfig(**saved)


def write_record(directory: Path, m: ModelConfig) -> None:
    record = {"format": RECORD_FORMAT, "model": dataclasses.asdict(m)}
    (Path(directory) / MODEL_RECORD).write_text(json.dumps(record, indent=2) + "\n")


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that it runs in one process when no process group exists or `no_dist` is
    set: what plait asks of it, so not worth a line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def read_metadata(directory: Path):
    """DCP's metadata of `directory` (its `.metadata`, through DCP's FileSystemReader)."""
    from torch.distributed.checkpoint import FileSystemReader

    d = Path(directory)
    if not d.is_dir():
        raise DCPError(f"dcp:{d}: no such directory")
    if not (d / DCP_METADATA).is_file():
        steps = sorted((p for p in d.glob("step-*") if (p / DCP_METADATA).is_file()),
                       key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
        hint = (f"; it holds DCP checkpoints: name one, e.g. dcp:{steps[-1]}" if steps
                else "; name the directory torch.distributed.checkpoint.save wrote")
        raise DCPError(f"dcp:{d}: no {DCP_METADATA}, not a DCP checkpoint{hint}")
    try:
        return FileSystemReader(str(d)).read_metadata()
    except Exception as e:  # DCP raises pickle's and its own untyped errors
        raise DCPError(f"dcp:{d}/{DCP_METADATA}: DCP cannot read it ({e})") from None


def _box_planner():
    """A DCP load planner whose state dict holds plain buffers, each a rectangle of its
    global tensor at `offsets[name]`; it appends its read items to `requests` (built
    lazily: importing DCP's planner costs time)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxPlanner(DefaultLoadPlanner):
        def __init__(self, offsets: dict[str, tuple[int, ...]], requests: list):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.offsets, self.requests = offsets, requests

        def create_local_plan(self) -> LoadPlan:
            items = []
            for name, buf in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[name]),
                                             sizes=buf.size())
                items += create_read_items_for_chunk_list(
                    name, self.metadata.state_dict_metadata[name], [chunk])
            self.requests += items
            return LoadPlan(items)

        def lookup_tensor(self, index) -> torch.Tensor:
            return self.state_dict[index.fqn]  # the buffer; dest_offsets are within it

    return BoxPlanner


class DCPWeights:
    """The tensors of a DCP directory, by torchtitan's names (the naming its names show:
    `naming`), read by rectangles."""

    def __init__(self, directory: Path, cfg: ModelConfig):
        self.dir, self.cfg = Path(directory), cfg
        self.meta = read_metadata(self.dir)
        self.prefix = self._prefix()
        ours = {k[len(self.prefix):] for k in self.meta.state_dict_metadata
                if k.startswith(self.prefix)}
        self.naming = detect(ours, cfg)
        self.names = titan_names(cfg, self.naming)
        self.read_items: list = []  # DCP's read requests of the last `load`

    def describe(self) -> str:
        """Which of torchtitan's namings the checkpoint holds, as a user reads it."""
        return f"torchtitan's {self.naming} names ({marks(self.naming)})"

    def _prefix(self) -> str:
        keys = self.meta.state_dict_metadata
        found = [k[:-len("tok_embeddings.weight")] for k in keys
                 if k.endswith("tok_embeddings.weight")]
        if len(found) != 1:
            shown = ", ".join(sorted(keys)[:4])
            raise DCPError(f"dcp:{self.dir}: {'no' if not found else 'several'} "
                           f"tok_embeddings.weight, not one torchtitan model (it holds "
                           f"{shown}{', ...' if len(keys) > 4 else ''})")
        return found[0]

    def shape(self, theirs: str) -> tuple[int, ...] | None:
        md = self.meta.state_dict_metadata.get(self.prefix + theirs)
        size = getattr(md, "size", None)  # BytesStorageMetadata has none
        return None if size is None else tuple(size)

    def check(self) -> None:
        """Every tensor the model needs is there with its shape, and nothing the block
        cannot represent is (a bias, a QK norm): from DCP's metadata only."""
        problems = []
        for theirs, want in self.names.values():
            found = self.shape(theirs)
            if found is None:
                problems.append(f"{theirs} is missing")
            elif found != want:
                problems.append(f"{theirs} is {list(found)} there, this run's model needs "
                                f"{list(want)}")
        known = {t for t, _ in self.names.values()} | {head_name(self.naming)}
        extra = sorted(k[len(self.prefix):] for k in self.meta.state_dict_metadata
                       if k.startswith(self.prefix) and k[len(self.prefix):] not in known
                       and k[len(self.prefix):].startswith(MODEL_ROOTS)
                       and not is_ignored(k[len(self.prefix):]))
        if extra:
            problems.append(f"tensors plait's block has no place for: {', '.join(extra[:4])}"
                            + (f" and {len(extra) - 4} more" if len(extra) > 4 else ""))
        if problems:
            raise DCPError(f"dcp:{self.dir}: the checkpoint (read as {self.describe()}) does "
                           "not fit the model: " + "; ".join(problems[:6]) + self._fix())

    def _fix(self) -> str:
        """The settings that give the run the checkpoint's shapes, as `--set`s."""
        at = {row: self.shape(theirs) for row, (theirs, _) in self.names.items()}
        emb, w1, wk = (at.get(n) for n in ("embed.weight", "layers.0.mlp.w1.weight",
                                            "layers.0.attn.wk.weight"))
        layers = {int(m[1]) for k in self.meta.state_dict_metadata
                  if (m := re.match(re.escape(self.prefix) + r"layers\.(\d+)\.", k))}
        m, want = self.cfg, {}
        if emb is not None:
            want.update(vocab_size=emb[0], dim=emb[1])
        if layers:
            want["n_layers"] = max(layers) + 1
        if w1 is not None:
            want["ffn_dim"] = w1[0]
        if self.shape(head_name(self.naming)) is None:
            want["tie_embeddings"] = True
        dim = want.get("dim", m.dim)
        if wk is not None and dim % m.n_heads == 0 and wk[0] % (dim // m.n_heads) == 0:
            want["n_kv_heads"] = wk[0] // (dim // m.n_heads)
        sets = " ".join(f"--set model.{k}={str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in want.items() if getattr(m, k) != v)
        return (f"; give the run the checkpoint's model ({sets}; n_heads, rope_theta and "
                "norm_eps are not in a DCP checkpoint: give torchtitan's)" if sets else "")

    def load(self, wanted: list[Piece]) -> int:
        """Fill each piece's live tensor; one DCP load for all of them. Returns the
        elements requested from DCP (the rectangles covering the pieces)."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint import load as dcp_load

        boxes = {}
        for p in wanted:  # the rectangle of each tensor that covers every piece of it
            theirs = self.prefix + self._titan(p.name)
            offset, shape, _ = covering_box(p)
            lo, hi = boxes.get(theirs, (offset, offset))
            hi = tuple(max(h, o + s) for h, o, s in zip(hi, offset, shape, strict=True))
            boxes[theirs] = (tuple(map(min, lo, offset)), hi)
        # host buffers: DCP reads files into them; the pieces are then copied to the device
        bufs = {n: torch.empty([h - o for o, h in zip(lo, hi, strict=True)], device="cpu")
                for n, (lo, hi) in boxes.items()}
        self.read_items = []
        with quiet_dcp():
            dcp_load(bufs, storage_reader=FileSystemReader(str(self.dir)), no_dist=True,
                     planner=_box_planner()({n: lo for n, (lo, _) in boxes.items()},
                                            self.read_items))
        with torch.no_grad():
            for p in wanted:
                theirs = self.prefix + self._titan(p.name)
                offset, shape, skip = covering_box(p)
                lo = boxes[theirs][0]
                block = bufs[theirs][tuple(slice(o - b, o - b + s) for o, b, s in
                                           zip(offset, lo, shape, strict=True))]
                p.tensor.copy_(cut(block, p, skip).reshape(p.tensor.shape))
        return sum(b.numel() for b in bufs.values())

    def _titan(self, ours: str) -> str:
        if ours == "head.weight" and self.cfg.tie_embeddings:
            return "tok_embeddings.weight"
        return self.names[ours][0]

    def full(self, ours: str) -> torch.Tensor:
        """The whole of plait parameter `ours`, fp32."""
        shape = self.names["embed.weight" if ours == "head.weight" else ours][1]
        n = math.prod(shape)
        out = torch.empty(shape, device="cpu")  # a whole tensor read on the host
        self.load([Piece(ours, "master", (0,) * len(shape), shape, 0, n, out, False)])
        return out


def describe_source(directory: Path, m: ModelConfig) -> str:
    """`dcp:DIR: N tensors in torchtitan's 2026 names (...)`: what a run reads, in a line."""
    weights = DCPWeights(directory, m)
    return f"dcp:{weights.dir}: {len(weights.names)} tensors in {weights.describe()}"


def load_into(par: ParallelModel, mesh: ParallelMesh, cfg, directory: Path) -> DCPWeights:
    """Fill this rank's part of `par` (its masters, the balancing biases, and the compute
    parameters where they are read directly) from a DCP directory; returns the reader
    (its naming, and DCP's read requests: `read_items`). No collective. The optimizer
    starts fresh (step 0)."""
    weights = DCPWeights(directory, cfg.model)
    weights.check()
    weights.load(initial_pieces(par, mesh, cfg.train.optimizer))
    par.optimizer.finish_load(0)
    return weights
