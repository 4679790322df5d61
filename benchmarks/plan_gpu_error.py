"""The planner's step time against published GPU runs from sources it may use (in sample:
plait/plan/data/ cites some of these sources for its hardware numbers).

    python benchmarks/plan_gpu_error.py [--write docs/results/plan_gpu_error.md]

Per run: the measured step time (the paper's own time, or its global batch's tokens over
its tokens per second), `plait plan`'s prediction with the published per-GPU numbers
(the default, `--efficiency published`) and with the older constants fitted on one A100
paper (`--efficiency fitted`), and the errors. Knobs a source does not report are chosen
as a practitioner would and named in the table. Then the published numbers' training rate
(`kernel_rate_in_training`: the share of the isolated kernel rates a training step's
kernels run at) fitted over these runs, the value plait/plan/data/gpu_efficiency.json
holds, and leave-one-source-out: the rate fitted without a source, that source's errors
(the out-of-sample estimate). The runs that score the planner are kept out of this
repository; none of them is here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import results  # noqa: E402

from plait.plan.basis import Layout, Training  # noqa: E402
from plait.plan.calibration import EFFICIENCY, load_runs  # noqa: E402
from plait.plan.error_band import DATA_FILE, stack_of, terms_of  # noqa: E402
from plait.plan.estimate import evaluate  # noqa: E402
from plait.plan.gpu_data import family_of, published, training_rate  # noqa: E402
from plait.plan.hardware import Cluster, get_gpu  # noqa: E402
from plait.plan.shape import Shape, from_preset  # noqa: E402
from plait.plan.stack import Stack  # noqa: E402

LLM_FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (MPT, FSDP "
               "FULL_SHARD, no activation checkpointing)")
TORCHTITAN = "pytorch/torchtitan docs/performance.md"
# torchtitan reduces FSDP's gradients in fp32 (its job config's `mixed_precision_reduce`
# defaults to "float32"): plait's precision with 4-byte gradients
FP32_REDUCE = "bf16-fp32grad"


def mpt(layers: int, hidden: int, heads: int, seq: int = 2048) -> Shape:
    """An MPT model as the GPT block (4h GeLU MLP, 50,368-token vocabulary)."""
    return Shape(layers, hidden, heads, heads, 4 * hidden, 50368, seq, arch="gpt",
                 name=f"MPT {layers}x{hidden}")


# llm-foundry's MPT and torchtitan's runs here are PyTorch eager (no torch.compile), with
# FlashAttention-2 (flash-attn 2; PyTorch SDPA's flash backend)
EAGER = Stack(fused_kernels=False)
EAGER_KNOBS = "FSDP: ZeRO-3; --fused-kernels no --attention-kernel fa2"
MEGATRON_BRIDGE = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, 25.11 container, "
                   "DGX-H100, FP8-CS")
# Megatron-Bridge's H100 recipes: Transformer Engine (fused kernels, cuDNN attention), the
# distributed optimizer (ZeRO-1) or Megatron FSDP (ZeRO-3), TP's collectives overlapped with
# the GEMMs (userbuffers, --tp-comm-overlap: plait's --async-tp). Its FP8 current-scaling
# recipe keeps the first and last block in bf16 and the weights in fp8: neither modelled
MEGATRON_KNOBS = "fused kernels, cuDNN attention, --precision fp8"


class Run(NamedTuple):
    name: str
    gpu: str
    shape: Shape
    gpus: int
    global_batch: int
    layout: Layout
    tokens_per_gpu_s: float
    source: str
    note: str = ""
    precision: str = "bf16"
    stack: Stack = EAGER
    attention_kernel: str = "fa2"
    knobs: str = EAGER_KNOBS


THROUGHPUT_RUNS = [
    Run("MPT-1B seq 2048", "h100-sxm", mpt(24, 2048, 16), 8, 112,
        Layout(dp=8, mbs=14, zero=3), 45455, LLM_FOUNDRY + ", H100 80GB BF16"),
    Run("MPT-7B seq 2048", "h100-sxm", mpt(32, 4096, 32), 8, 48,
        Layout(dp=8, mbs=6, zero=3), 10643, LLM_FOUNDRY + ", H100 80GB BF16"),
    Run("MPT-13B seq 2048", "h100-sxm", mpt(40, 5120, 40), 8, 16,
        Layout(dp=8, mbs=2, zero=3), 4792, LLM_FOUNDRY + ", H100 80GB BF16"),
    Run("MPT-1B seq 2048", "a100-80gb", mpt(24, 2048, 16), 8, 448,
        Layout(dp=8, mbs=14, zero=3), 20513, LLM_FOUNDRY + ", A100 80GB"),
    Run("MPT-7B seq 2048", "a100-80gb", mpt(32, 4096, 32), 8, 96,
        Layout(dp=8, mbs=6, zero=3), 4641, LLM_FOUNDRY + ", A100 80GB"),
    Run("Llama 3.1 8B seq 8192", "h100-sxm", from_preset("llama3-8b", 8192), 8, 16,
        Layout(dp=8, mbs=2, zero=3, recompute="selective"), 5762, TORCHTITAN + ", Table 1",
        "their H100s: 96 GB HBM2e at 500 W (the preset: SXM 80 GB, 700 W); fp32 reduce",
        precision=FP32_REDUCE),
    Run("Llama 3 8B seq 8192", "a100-80gb", from_preset("llama3-8b", 8192), 64, 64,
        Layout(dp=64, mbs=1, zero=3, recompute="selective"), 2973,
        TORCHTITAN + ", Llama 3 on 64 A100",
        "sequence length not stated: 8192 assumed; fp32 reduce", precision=FP32_REDUCE),
    Run("Llama 3 8B seq 8192 fp8", "h100-sxm", from_preset("llama3-8b", 8192), 8, 128,
        Layout(dp=8, mbs=1, zero=3), 14451, MEGATRON_BRIDGE, "Megatron FSDP: ZeRO-3",
        precision="fp8", stack=Stack(), attention_kernel="auto", knobs=MEGATRON_KNOBS),
    Run("Llama 3 70B seq 8192 fp8", "h100-sxm", from_preset("llama3-70b", 8192), 64, 128,
        Layout(tp=4, pp=8, dp=2, mbs=1, zero=1, schedule="interleaved", v=5, async_tp=True),
        1602, MEGATRON_BRIDGE, "distributed optimizer: ZeRO-1; --async-tp",
        precision="fp8", stack=Stack(), attention_kernel="auto", knobs=MEGATRON_KNOBS),
    Run("Llama 3.1 405B seq 8192 fp8", "h100-sxm", from_preset("llama3-405b", 8192), 1024,
        512, Layout(tp=8, pp=8, cp=2, dp=8, mbs=1, zero=1, schedule="interleaved", v=8,
                    async_tp=True),
        292, MEGATRON_BRIDGE, "distributed optimizer: ZeRO-1; --async-tp",
        precision="fp8", stack=Stack(), attention_kernel="auto", knobs=MEGATRON_KNOBS),
]


class Series(NamedTuple):
    """One model on one GPU at several GPU counts (the source's own rows): is the change
    of tokens/s per GPU with the GPU count predicted with the right sign?"""

    name: str
    gpu: str
    shape: Shape
    # (GPUs, global batch, micro-batch, measured tokens/s per GPU), by GPU count
    points: tuple[tuple[int, int, int, float], ...]
    source: str


# llm-foundry's H100 BF16 table, seq 2048, no activation checkpointing, FSDP FULL_SHARD;
# the shapes are its yamls' (scripts/train/yamls/pretrain/mpt-*.yaml: d_model, n_heads,
# n_layers). Not in the training rate's fit: only the direction of change is scored
SCALING_SERIES = [
    Series("MPT-760m seq 2048", "h100-sxm", mpt(24, 1536, 12),
           ((8, 384, 24, 63147), (16, 384, 24, 68551), (32, 768, 24, 67971)),
           LLM_FOUNDRY + ", H100 80GB BF16"),
    Series("MPT-1B seq 2048", "h100-sxm", mpt(24, 2048, 16),
           ((8, 112, 14, 45455), (16, 320, 20, 46037), (32, 640, 20, 45130),
            (64, 1280, 20, 44402)), LLM_FOUNDRY + ", H100 80GB BF16"),
    Series("MPT-3B seq 2048", "h100-sxm", mpt(32, 2560, 20),
           ((16, 480, 10, 24142), (32, 576, 6, 23021), (64, 1152, 6, 22525)),
           LLM_FOUNDRY + ", H100 80GB BF16"),
    Series("MPT-13B seq 2048", "h100-sxm", mpt(40, 5120, 40),
           ((8, 16, 2, 4792), (16, 32, 2, 4767), (32, 64, 2, 4811), (64, 128, 2, 4800)),
           LLM_FOUNDRY + ", H100 80GB BF16"),
]
# a change of tokens/s per GPU within 1 % counts as flat: the tables' runs are 12 steps
# each (llm-foundry's README), below what their step-to-step spread resolves
FLAT = 0.01


def direction(change: float, flat: float = FLAT) -> int:
    """+1 faster per GPU, -1 slower, 0 flat (within `flat`)."""
    return 0 if abs(change) <= flat else (1 if change > 0 else -1)


def series_rows(series: list[Series]) -> list[tuple]:
    """Per step of GPU count: the measured and predicted change of tokens/s per GPU and
    whether their directions agree (the published numbers, the data file's rate)."""
    out = []
    for sr in series:
        pub = published(get_gpu(sr.gpu), "fa2")
        pred = []
        for n, batch, mbs, _ in sr.points:
            est = evaluate(sr.shape, Cluster(pub.gpu, n), Training(batch, stack=EAGER),
                           Layout(dp=n, mbs=mbs, zero=3), pub.eff, simulate=True)
            pred.append(batch * sr.shape.seq / float(est.step_time) / n)
        for (a, b), (pa, pb) in zip(zip(sr.points, sr.points[1:]), zip(pred, pred[1:])):
            meas, model = b[3] / a[3] - 1, pb / pa - 1
            out.append((sr.name, f"{a[0]} -> {b[0]}", f"{100 * meas:+.1f} %",
                        f"{100 * model:+.1f} %", direction(meas) == direction(model)))
    return out


def series_table(series: list[Series]) -> tuple[str, str]:
    """The scaling series' table and the count of steps with the right direction."""
    rows = series_rows(series)
    right = sum(r[-1] for r in rows)
    text = results.table(("series", "GPUs", "measured change of tokens/s/GPU",
                          "predicted change", "same direction"),
                         [(*r[:-1], "yes" if r[-1] else "no") for r in rows])
    return text, (f"Scaling series ({SCALING_SERIES[0].source.split(' ')[0]}): the direction "
                  f"of change (within ±{100 * FLAT:.0f} %: flat) right on {right} of "
                  f"{len(rows)} steps of GPU count.")


class Case(NamedTuple):
    name: str
    gpu: str
    source_family: str  # the source, for leave-one-source-out
    shape: Shape
    cluster: Cluster
    train: Training
    layout: Layout
    attention_kernel: str
    measured_s: float
    source: str
    knobs: str


def cases() -> list[Case]:
    out = []
    for run in load_runs():  # Korthikanti et al. 2022, Table 5 (the calibration set)
        out.append(Case(f"GPT {run.name}", "a100-80gb", "Korthikanti et al. 2022", run.shape,
                        run.cluster, run.train, run.layout, "auto", run.measured_s,
                        "Korthikanti et al. 2022, Table 5 (in the fit of `fitted`)",
                        "Megatron-LM 2022: sends waited on, no DP"))
    for r in THROUGHPUT_RUNS:
        family = r.source.split(" ")[0]
        out.append(Case(r.name, r.gpu, family, r.shape, Cluster(get_gpu(r.gpu), r.gpus),
                        Training(r.global_batch, precision=r.precision, stack=r.stack),
                        r.layout, r.attention_kernel,
                        r.global_batch * r.shape.seq / (r.tokens_per_gpu_s * r.gpus), r.source,
                        (r.note + "; " if r.note else "") + r.knobs))
    return out


def predict(c: Case, mode: str, rate: float | None = None) -> float:
    """The step time `plait plan` predicts: the published numbers (their training rate,
    or `rate`) or the fitted constants."""
    cluster = c.cluster
    if mode == "fitted":
        eff = EFFICIENCY
    else:
        pub = published(cluster.gpu, c.attention_kernel, rate=rate)
        cluster, eff = replace(cluster, gpu=pub.gpu), pub.eff
    return float(evaluate(c.shape, cluster, c.train, c.layout, eff, simulate=True).step_time)


RATES = [round(0.6 + 0.005 * k, 3) for k in range(81)]  # 0.600 ... 1.000


def fit_rate(times: dict[float, list[float]], measured: list[float], idx: list[int]) -> float:
    """The rate of RATES whose predictions of runs `idx` have the least mean |log error|."""
    return min(RATES, key=lambda r: sum(abs(math.log(times[r][i] / measured[i])) for i in idx))


def rate_tables(cs: list[Case]) -> tuple[str, str, dict[int, float]]:
    """The training rate fitted over every run, and leave-one-source-out: fitted without a
    source, the errors of that source's runs (also returned, by the run's index)."""
    measured = [c.measured_s for c in cs]
    times = {r: [predict(c, "published", r) for c in cs] for r in RATES}
    best = fit_rate(times, measured, list(range(len(cs))))
    rows, held, by_run = [], [], {}
    for fam in dict.fromkeys(c.source_family for c in cs):
        out_idx = [i for i, c in enumerate(cs) if c.source_family == fam]
        rate = fit_rate(times, measured, [i for i in range(len(cs)) if i not in out_idx])
        errs = [(times[rate][i] - measured[i]) / measured[i] for i in out_idx]
        held += errs
        by_run.update(zip(out_idx, errs, strict=True))
        rows.append((fam, f"{rate:.3f}", len(out_idx),
                     f"{100 * sum(map(abs, errs)) / len(errs):.1f} %",
                     " ".join(f"{100 * e:+.1f}" for e in errs)))
    rows.append(("all held out", "", len(held), f"{100 * sum(map(abs, held)) / len(held):.1f} %",
                 f"worst {100 * max(map(abs, held)):.1f} %"))
    text = results.table(("source left out", "rate fitted on the others", "runs",
                          "mean |error|", "errors, %"), rows)
    summary = (f"Training rate fitted over all {len(cs)} runs: {best:.3f} (the data file's "
               f"`kernel_rate_in_training`: {training_rate():.3f}).")
    return text, summary, by_run


def bands(cs: list[Case], held: dict[int, float]) -> dict:
    """The data file plait plan's step-time range reads (plait/plan/error_band.py): each
    run's GPU family, GPU count, kernel stack, the terms its layout rests on and its
    held-out error."""
    return {"about": "Written by benchmarks/plan_gpu_error.py --write-bands: each published "
                     "run's leave-one-source-out error ((predicted - measured) / measured, "
                     "the training rate fitted without the run's source), read by "
                     "plait/plan/error_band.py to print a plan's step time as a range.",
            "source": f"leave-one-source-out over the {len(cs)} runs of "
                      "benchmarks/plan_gpu_error.py",
            "runs": [{"name": c.name, "family": family_of(c.cluster.gpu.name),
                      "gpus": c.cluster.n_gpus,
                      "stack": stack_of(c.train.stack.fused_kernels),
                      "terms": terms_of(c.layout.sizes, c.layout.schedule, c.layout.zero,
                                        c.layout.recompute, bool(c.shape.moe)),
                      "source": c.source,
                      "error": round(held[i], 4)} for i, c in enumerate(cs)]}


def rows(cs: list[Case]) -> list[tuple]:
    return [(c.name, c.gpu, c.cluster.n_gpus, c.measured_s, predict(c, "published"),
             predict(c, "fitted"), c.source, c.knobs) for c in cs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    results.add_write_flag(ap)
    ap.add_argument("--write-bands", action="store_true",
                    help=f"also write plait/plan/data/{DATA_FILE} (the held-out errors "
                         "plait plan's step-time range reads)")
    args = ap.parse_args()
    cs = cases()
    table_rows, errs = [], {"published": [], "fitted": []}
    for name, gpu, n, meas, pub, fit, src, note in rows(cs):
        e_pub, e_fit = (pub - meas) / meas, (fit - meas) / meas
        errs["published"].append(abs(e_pub))
        errs["fitted"].append(abs(e_fit))
        table_rows.append((name, gpu, n, f"{meas:.3f}", f"{pub:.3f}", f"{100 * e_pub:+.1f} %",
                           f"{fit:.3f}", f"{100 * e_fit:+.1f} %", src, note))
    summary = [(m, f"{100 * sum(v) / len(v):.1f} %", f"{100 * max(v):.1f} %")
               for m, v in errs.items()]
    text = results.table(("run", "GPU", "GPUs", "measured s", "published s", "error",
                          "fitted s", "error", "source", "knobs chosen"), table_rows)
    summ = results.table(("--efficiency", "mean |error|", "worst |error|"), summary)
    loso, rate_line, held = rate_tables(cs)
    scaling, scaling_line = series_table(SCALING_SERIES)
    if args.write_bands:
        path = Path(__file__).resolve().parents[1] / "plait" / "plan" / "data" / DATA_FILE
        path.write_text(json.dumps(bands(cs, held), indent=1) + "\n", encoding="utf-8")
    print("\n\n".join([text, summ, rate_line, loso, scaling_line, scaling]))
    if args.write:
        results.write(args.write, "Planner step time against published GPU runs (in sample)",
                      [text, summ, rate_line, loso, scaling_line, scaling],
                      "IN SAMPLE: every run here is from a source plait may read, and the "
                      "published numbers' training rate (`kernel_rate_in_training`) is fitted "
                      "to these runs, as `fitted`'s constants are to Korthikanti et al.'s; the "
                      "leave-one-source-out table is the out-of-sample estimate: the rate "
                      "fitted without a source, that source's errors. The held-out runs that "
                      "score the planner are not in this repository. Error = (predicted - "
                      "measured) / measured; negative: predicted too fast.")


if __name__ == "__main__":
    main()
