"""Read back what plait's metric sinks wrote: a TensorBoard event directory (tensorboard's
own EventAccumulator) and an offline W&B run (its `run-ID.wandb` transaction log).

wandb 0.31 ships no Python reader for the offline log, so this one reads the format:
a 7-byte header (b":W&B", magic 0xBEE1 little-endian, version 0), then the LevelDB log
format (LevelDB's doc/log_format.md): 32 KiB blocks of records, each a 7-byte header
(masked CRC32C, uint32; length, uint16; type, uint8: 1 full, 2 first, 3 middle, 4 last)
and its bytes; a block's tail shorter than a header is padding. Each whole record is a
`wandb.proto.wandb_internal_pb2.Record` protobuf (wandb's own message classes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, as float64 (plait writes double-precision tensors)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["tensors"]:
        for ev in acc.Tensors(tag):
            out.setdefault(tag, {})[ev.step] = tensor_util.make_ndarray(ev.tensor_proto).item()
    return out


def _payloads(data: bytes) -> list[bytes]:
    """The whole records of a LevelDB-format log that starts after the file header."""
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # zero fill past the last record
            break
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
            pending = b""
    return records


def _item_value(item) -> object:
    return json.loads(item.value_json)


def wandb_offline_run(wandb_dir: Path) -> dict:
    """The one offline run under `wandb_dir`: its history (step -> key -> value), the last
    summary's values, and its config, decoded from the run's transaction log."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    data = log.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    history: dict[int, dict] = {}
    summary: dict = {}
    config: dict = {}
    for payload in _payloads(data):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): _item_value(i) for i in rec.history.item}
            history[int(row.pop("_step"))] = row
        elif kind == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): _item_value(i)
                            for i in rec.summary.update})
        elif kind == "config":
            config.update({i.key: _item_value(i) for i in rec.config.update})
        elif kind == "run":
            config.update({i.key: _item_value(i) for i in rec.run.config.update})
    return {"history": history, "summary": summary, "config": config, "path": log}
