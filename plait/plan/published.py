"""What a preset's own paper reports about its training run: the global batch the plan
takes when none is given, and the throughput `plait plan` prints beside its own.

DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"): section 1 and Table 1,
180K H800 GPU-hours per trillion training tokens (2.664M GPU-hours for 14.8T tokens), i.e.
1e12 / (180e3 x 3600) = 1,543 tokens per second per GPU, on 2048 H800 GPUs (section 3.1)
with 16-way pipeline (DualPipe), 64-way expert parallel over 8 nodes and ZeRO-1 data
parallel (section 3.1), in FP8 mixed precision (section 3.3); batch 15360 sequences of
4K tokens after the first 469B tokens (section 4.2).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    gpu: str  # the plan's GPU preset of the run
    gpus: int
    tokens_per_gpu_s: float
    global_batch: int  # sequences
    layout: str
    source: str


PUBLISHED: dict[str, Published] = {
    "deepseek-v3": Published(
        gpu="h800", gpus=2048, tokens_per_gpu_s=1e12 / (180e3 * 3600), global_batch=15360,
        layout="pp=16 (DualPipe), ep=64 over 8 nodes, ZeRO-1 dp, no tp, FP8 GEMMs",
        source="DeepSeek-V3 technical report, section 1 and Table 1: 180K H800 GPU-hours "
               "per trillion tokens"),
}


def published_batch(model: str | None) -> int | None:
    """The paper's global batch (sequences) for preset `model`, None where none is kept."""
    entry = PUBLISHED.get(model or "")
    return None if entry is None else entry.global_batch


def throughput_note(model: str | None, shape_name: str, gpu: str, n_gpus: int,
                    tokens_per_s: float, precision: str) -> str | None:
    """One line: the plan's best tokens/s per GPU beside the paper's own figure (None for
    a preset without one, or a modified one)."""
    entry = PUBLISHED.get(model or "")
    if entry is None or shape_name != model:
        return None
    ours = tokens_per_s / n_gpus
    same = gpu == entry.gpu and n_gpus == entry.gpus
    where = "" if same else f" (on {entry.gpus} x {entry.gpu}; this plan: {n_gpus} x {gpu})"
    return (f"Tokens/s per GPU: this plan's best {ours:,.0f}; the paper's own "
            f"{entry.tokens_per_gpu_s:,.0f}{where} ({entry.source}; its layout: "
            f"{entry.layout}). This plan prices {precision} GEMMs: FP8's doubled peak and "
            "the paper's custom all-to-all and overlap are not modelled.")
