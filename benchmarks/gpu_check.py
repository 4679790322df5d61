"""GPU check: one table of what plait does on this machine's CUDA GPUs (docs/gpu.md).

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--out gpu-check.md] [--budget-s 480]
    make gpu-check                                   # the same, with the system python3
    PYTHONPATH=. python3 benchmarks/gpu_check.py --device cpu --smoke   # the code paths, tiny

Sections, in order, each in a process of its own (a fresh CUDA context, a fresh process
group, its memory released when it ends) under what is left of `--budget-s`:

1. `throughput` (one GPU): a 1.14 B-parameter Llama-style model (width 2048, 16 layers,
   16 heads of 128, 8 KV heads, SwiGLU 8192, vocabulary 32000) at sequence 4096, bf16
   compute with fp32 masters: tokens/s and MFU beside `plait plan --gpus 1` for the same
   model, layout and batch on the detected GPU's preset (H100/H200/B200 by
   `torch.cuda.get_device_name`; any other GPU: `--gpu NAME` or `--peak-tflops` etc.).
2. `dry-run` (one GPU): rank 0 and rank 1023 (the first and last pipeline rank) of
   llama3-8b at tp=8, pp=4, dp=32 on torch's fake process group: the tracker's peak and
   `torch.cuda.max_memory_allocated` beside the planner's (eager) prediction.
3. `parity` (two GPUs or more, NCCL): dp=2, tp=2 + SP, pp=2 (1f1b, zb-v), ZeRO-3 against
   the one-GPU run of the same config at the parity tolerances of plait/testing.py (fp32;
   and dp=2 in bf16 with fp32 masters at the bf16 class).
4. `peers` (two GPUs or more): step time of plait's bucketed DP over torch DDP, and of
   plait's ZeRO-3 over torch FSDP2 (`fully_shard`), same model, weights and batches.
5. `fp8` (one GPU with float8 tensor cores, sm >= 8.9): section 1's model and batch with
   `--precision bf16` and `--precision fp8`, tokens/s and MFU of each beside
   `plait plan --precision` (benchmarks/gpu_check_fp8.py); skipped with a line elsewhere.
6. `compile` (one GPU): section 1's model eager and with `--compile` (inductor): tokens/s,
   MFU, the speed-up and the compile seconds (benchmarks/gpu_check_speedups.py).
7. `async-tp` (two GPUs or more): the same model at tp = the GPUs with SP, plain and
   `--async-tp`: tokens/s, MFU and the exposed and hidden tp communication per step.

On one GPU sections 3, 4 and 7 print that they need two. A section that fails prints its
error in the table (and its traceback on stderr) and the next one runs; once the budget
left is below a section's floor, it and the rest are skipped with a line saying so.
`--smoke` (tiny models, seconds) runs every code path; on CPU the multi-rank sections run
on gloo ranks (`--devices N`: how many ranks the machine offers; default: the GPUs seen,
or 2 on CPU). Needs only torch (and numpy, rich) and this source tree.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# section -> (GPUs it needs, seconds below which it is not started)
SECTIONS = {"throughput": (1, 60), "dry-run": (1, 60), "parity": (2, 90), "peers": (2, 60),
            "fp8": (1, 90), "compile": (1, 120), "async-tp": (2, 90)}
# torch.cuda.get_device_name substring -> the planner's preset (plait/plan/hardware.py)
GPU_PRESETS = (("H200", "h200"), ("B200", "b200"), ("H100", "h100-sxm"),
               ("A100-SXM4-40GB", "a100-40gb"), ("A100", "a100-80gb"))
ONE_B = ("model.vocab_size=32000", "model.dim=2048", "model.n_layers=16", "model.n_heads=16",
         "model.n_kv_heads=8", "model.ffn_dim=8192", "model.max_seq_len=4096")


def preset_for(device_name: str) -> str | None:
    """The planner's GPU preset for a CUDA device name, or None (not a known part)."""
    for needle, preset in GPU_PRESETS:
        if needle in device_name.upper():
            return preset
    return None


def _token_file(tmp: Path, vocab: int, tokens: int) -> Path:
    from plait.train.data import synthetic_token_file

    return synthetic_token_file(tmp / f"t{vocab}.bin", tokens, vocab, seed=1)


def _batches(cfg, path: Path):
    from plait.train.data import GlobalBatches, TokenFile

    t = cfg.train
    return GlobalBatches(TokenFile.open(path), t.seq_len, t.global_batch, t.seed,
                         cfg.model.vocab_size)


# ---- section 1: one GPU, tokens/s and MFU beside the planner -----------------------------

def _throughput_config(args, recompute: str):
    from plait.config import load_config

    if args.smoke:
        model, seq, micro, steps = ("model.vocab_size=256",), 64, 2, 3
    else:
        model, seq, micro, steps = ONE_B, 4096, args.microbatches, args.steps
    prec = "fp32" if args.device == "cpu" else "bf16"
    return load_config(overrides={"model_name": "tiny"}, sets=[
        *model, f"train.seq_len={seq}", f"train.global_batch={micro}",
        f"parallel.microbatches={micro}", f"train.steps={steps}", f"train.precision={prec}",
        f"train.recompute={recompute}"]).check(1)


def _fitting_config(args, gpu: str):
    """The throughput config with the least recompute the planner says fits (`--recompute
    auto`: none, else selective, else full; the issue's "recompute only if needed")."""
    modes = ("none", "selective", "full") if args.recompute == "auto" else (args.recompute,)
    for mode in modes:
        cfg = _throughput_config(args, mode)
        plan = planned(cfg, args, gpu)
        if plan["fits"]:
            break
    return cfg, plan


def planned(cfg, args, gpu: str, *flags: str) -> dict:
    """`plait plan --gpus 1 FLAGS` for this config's model and layout, as JSON (the first
    layout)."""
    import io

    from plait.plan.cli import add_arguments, run

    m, t = cfg.model, cfg.train
    argv = ["--layers", m.n_layers, "--hidden", m.dim, "--heads", m.n_heads, "--kv-heads",
            m.n_kv_heads, "--ffn", m.ffn_dim, "--vocab", m.vocab_size, "--seq", t.seq_len,
            "--gpus", 1, "--gpu", gpu, "--global-batch", t.global_batch, "--layout",
            "tp=1,pp=1,dp=1", "--microbatch", cfg.micro_batch_size(), "--zero",
            cfg.parallel.zero, "--recompute", t.recompute, *flags, "--json"]
    for flag in ("peak_tflops", "hbm_gb", "hbm_bw_gbs"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = io.StringIO()
    if run(p.parse_args([str(a) for a in argv]), out=out) != 0:
        raise RuntimeError(f"plait plan {' '.join(flags)} failed: {out.getvalue().strip()}")
    return json.loads(out.getvalue())["layouts"][0]


def section_throughput(args, tmp: Path) -> list[dict]:
    from plait.device import resolve_device
    from plait.mesh import ParallelMesh
    from plait.throughput import tokens_per_second, tokens_per_step
    from plait.train.loop import train

    device = resolve_device(args.device, 0)
    device.activate()
    gpu, source = _gpu_preset(args, device)
    cfg, plan = _fitting_config(args, gpu)
    path = _token_file(tmp, cfg.model.vocab_size, 4 * cfg.train.global_batch *
                       (cfg.train.seq_len + 1) * cfg.train.steps)
    result = train(cfg, ParallelMesh.build(cfg.parallel, device=device), _batches(cfg, path))
    times = [m["step_time"] for m in result.metrics]
    tps = tokens_per_second(tokens_per_step(cfg.train.global_batch, cfg.train.seq_len), times)
    from plait.plan.hardware import get_gpu

    peak = get_gpu(gpu, peak_flops=args.peak_tflops and args.peak_tflops * 1e12).peak_flops
    mfu = tps * cfg.model.flops_per_token(cfg.train.seq_len) / peak
    label = (f"{cfg.model.num_params() / 1e9:.2f} B params, seq {cfg.train.seq_len}, "
             f"{cfg.train.precision}, batch {cfg.train.global_batch}, recompute "
             f"{cfg.train.recompute}; planner: {gpu} ({source})")
    rows = [{"section": "throughput", "check": "tokens/s (1 device)", "measured": f"{tps:,.0f}",
             "expected": f"{plan['tokens_per_s']:,.0f} planned", "result": label},
            {"section": "throughput", "check": "MFU", "measured": f"{mfu:.1%}",
             "expected": f"{plan['mfu']:.1%} planned; target >= 45 %",
             "result": "ok" if mfu >= 0.45 else "below 45 %"}]
    if device.is_cuda:  # the whole run's allocator peak beside the planner's (fused) peak
        import torch

        peak_bytes = torch.cuda.max_memory_allocated(device.torch)
        rows.append({"section": "throughput", "check": "max_memory_allocated",
                     "measured": _gib(peak_bytes),
                     "expected": _gib(plan["memory_total_bytes"]) + " planned",
                     "result": _within(peak_bytes, plan["memory_total_bytes"], rel=0.15)})
    return rows


def _gpu_preset(args, device) -> tuple[str, str]:
    """The planner's GPU for this device: --gpu, else the preset of its name."""
    if args.gpu:
        return args.gpu, "--gpu"
    if device.is_cuda:
        import torch

        name = torch.cuda.get_device_name(device.torch)
        preset = preset_for(name)
        if preset is not None:
            return preset, f"detected {name}"
        if args.peak_tflops is None:
            raise RuntimeError(f"{name} has no preset: give --gpu NAME or --peak-tflops "
                               "(and --hbm-gb, --hbm-bw-gbs)")
        return "h100-sxm", f"{name}: numbers from the command line"
    return "h100-sxm", "CPU run: the preset stands in; numbers are not comparable"


# ---- section 2: the 8B dry run's first and last rank ------------------------------------

def section_dry_run(args, tmp: Path) -> list[dict]:
    """Each rank in a process of its own (the fake process group is per process)."""
    from plait.config import load_config
    from plait.device import resolve_device
    from plait.observe.dry_run import dry_run_ranks

    if args.smoke:
        dims, model, seq, micro = {"pp": 2}, "tiny", 32, 2
    else:
        dims, model, seq, micro = {"tp": 8, "pp": 4, "dp": 32}, "llama3-8b", args.dry_seq_len, 4
    world = dims.get("tp", 1) * dims["pp"] * dims.get("dp", 1)
    layout = ",".join(f"{k}={v}" for k, v in dims.items())
    cfg = load_config(overrides={"model_name": model}, sets=[
        *(f"parallel.{k}={v}" for k, v in dims.items()), f"parallel.microbatches={micro}",
        f"train.seq_len={seq}", f"train.global_batch={dims.get('dp', 1) * micro}",
        "train.steps=2"]).check(world)
    path = _token_file(tmp, cfg.model.vocab_size, 4 * seq * 64)
    outs = dry_run_ranks(cfg, world, [0, world - 1], path, resolve_device(args.device),
                         timeout_s=args.section_timeout)
    rows = []
    for out in outs:
        pred, mem = out["predicted_memory"], out["memory"]
        what = f"{model} {layout} seq {seq}: rank {out['rank']} (pp {out['coords']['pp']})"
        total = pred.get("total")
        expected = "-" if total is None else _gib(total) + " planned"
        rows.append({"section": "dry-run", "check": f"{what} tracker peak",
                     "measured": _gib(mem["peak_total"]), "expected": expected,
                     "result": _within(mem["peak_total"], total)})
        if "allocator_peak" in mem:
            rows.append({"section": "dry-run", "check": f"{what} max_memory_allocated",
                         "measured": _gib(mem["allocator_peak"]), "expected": expected,
                         "result": _within(mem["allocator_peak"], total)})
        rows.append({"section": "dry-run", "check": f"{what} wall time",
                     "measured": f"{out['seconds']:.0f} s", "expected": "-", "result": "-"})
    return rows


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB"


def _within(measured: float, predicted: float | None, rel: float = 0.05) -> str:
    if not predicted:
        return "no prediction"
    gap = measured / predicted - 1
    return f"{gap:+.1%} ({'ok' if abs(gap) <= rel else 'over 5 %'})"


# ---- the driver ---------------------------------------------------------------------------

def run_section(name: str, args) -> list[dict]:
    """One section in this process (the child the driver started)."""
    import gpu_check_fp8
    import gpu_check_multi
    import gpu_check_speedups

    fns = {"throughput": section_throughput, "dry-run": section_dry_run,
           "parity": gpu_check_multi.section_parity, "peers": gpu_check_multi.section_peers,
           "fp8": gpu_check_fp8.section_fp8, "compile": gpu_check_speedups.section_compile,
           "async-tp": gpu_check_speedups.section_async_tp}
    with tempfile.TemporaryDirectory() as tmp:
        return fns[name](args, Path(tmp))


def _devices(args) -> int:
    if args.devices is not None:
        return args.devices
    if args.device == "cpu":
        return 2
    import torch

    return torch.cuda.device_count()


def _child_argv(args, name: str, result: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--section", name,
            "--result", str(result), "--device", args.device, "--recompute", args.recompute,
            "--steps", str(args.steps), "--microbatches", str(args.microbatches),
            "--dry-seq-len", str(args.dry_seq_len), "--section-timeout",
            str(args.section_timeout)]
    for flag in ("gpu", "peak_tflops", "hbm_gb", "hbm_bw_gbs"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + (["--smoke"] if args.smoke else [])


def drive(args) -> list[dict]:
    """Every asked-for section in a child process, within the budget; their rows."""
    start, devices, rows = time.monotonic(), _devices(args), []
    for name in args.sections:
        need, floor = SECTIONS[name]
        left = max(0.0, args.budget_s - (time.monotonic() - start))
        if devices < need:
            rows.append(_note(name, f"needs >= {need} GPUs; this machine has {devices}"))
            continue
        if left < (5 if args.smoke else floor):
            rows.append(_note(name, f"skipped: {left:.0f} s of --budget-s left, the section "
                              f"needs about {floor} s"))
            continue
        args.section_timeout = int(left)
        if args.in_process:  # the test's way: no child, no budget enforcement
            rows += run_section(name, args)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "rows.json"
            t0 = time.monotonic()
            try:
                subprocess.run(_child_argv(args, name, result), timeout=left, check=True)
                rows += json.loads(result.read_text())
            except subprocess.TimeoutExpired:
                rows.append(_note(name, f"stopped at the budget ({left:.0f} s left)"))
            except (subprocess.CalledProcessError, OSError, ValueError) as e:
                rows.append(_note(name, f"failed: {e} (traceback above)"))
            print(f"gpu_check: {name} took {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return rows


def _note(section: str, text: str) -> dict:
    return {"section": section, "check": "-", "measured": "-", "expected": "-",
            "result": text}


def table(rows: list[dict], header: str) -> str:
    cols = ("section", "check", "measured", "expected", "result")
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(" ".join(str(r[c]).replace("|", "/").split()) for c in cols)
              + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _header(args) -> str:
    import platform

    import torch

    gpus = "no CUDA"
    if args.device != "cpu" and torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        gpus = f"{torch.cuda.device_count()} x {', '.join(sorted(names))}"
    return (f"plait gpu check: torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"Python {platform.python_version()}, {gpus}, device {args.device}"
            f"{', smoke sizes' if args.smoke else ''}; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes: the code paths only")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   type=lambda s: [x for x in s.split(",") if x],
                   help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="seconds for everything (default 480); later sections are skipped")
    p.add_argument("--devices", type=int, help="GPUs (CPU: ranks) to use; default: all seen")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    p.add_argument("--gpu", help="the planner's preset for this GPU (default: by its name)")
    p.add_argument("--peak-tflops", type=float, help="an unlisted GPU: dense bf16 TFLOP/s")
    p.add_argument("--hbm-gb", type=float, help="an unlisted GPU: HBM GB")
    p.add_argument("--hbm-bw-gbs", type=float, help="an unlisted GPU: HBM GB/s")
    p.add_argument("--recompute", default="auto", choices=("auto", "none", "selective", "full"),
                   help="throughput: auto (default) is the least the planner says fits")
    p.add_argument("--steps", type=int, default=6, help="throughput steps (first: warm-up)")
    p.add_argument("--microbatches", type=int, default=8, help="throughput: sequences/step")
    p.add_argument("--dry-seq-len", type=int, default=1024)
    p.add_argument("--in-process", action="store_true",
                   help="run the sections in this process (tests; a failure stops the check)")
    p.add_argument("--section", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--section-timeout", type=int, default=600, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.section:  # a child: one section, its rows to --result
        try:
            rows = run_section(args.section, args)
        except Exception as e:  # noqa: BLE001 - the row says it failed; stderr says why
            traceback.print_exc()
            last = str(e).strip().splitlines()[-1:] or [""]
            rows = [_note(args.section, f"failed: {type(e).__name__}: {last[0]}"[:300])]
        Path(args.result).write_text(json.dumps(rows))
        return 0
    if args.device == "cuda" and _devices(args) == 0:
        print("gpu_check: torch sees no CUDA GPU here; on a GPU machine run it there, or "
              "--device cpu --smoke for the code paths on CPU", file=sys.stderr)
        return 2
    text = table(drive(args), _header(args))
    print(text, end="")
    if args.out:
        from plait.files import write_text_atomic

        write_text_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
