"""The GPU check script (benchmarks/gpu_check.py) runs its code paths on CPU at smoke sizes,
so that it cannot rot between the rare runs on a lent GPU: the one-device throughput beside
the planner, the first and last pipeline rank of a dry run, the two-GPU sections' line on a
machine with one, bf16 against fp8 beside the planner (float8 emulated), the --budget-s
guard, and the markdown table written by --out."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.slow  # every section of the GPU check at smoke sizes, on this CPU
def test_gpu_check_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--in-process", "--devices", "1",
                           "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text() == text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][1:]
    checks = {(r[0].strip("| "), r[1]) for r in rows}
    assert ("throughput", "tokens/s (1 device)") in checks and ("throughput", "MFU") in checks
    assert ("compile", "speed-up (tokens/s)") in checks  # eager and compiled (aot_eager)
    dry = [r for r in rows if r[0] == "| dry-run" and "tracker peak" in r[1]]
    assert [("rank 0 (pp 0)" in dry[0][1]), ("rank 1 (pp 1)" in dry[1][1])] == [True, True]
    assert all(r[4].endswith("(ok) |") for r in dry), dry  # the planner's eager peak, 5 %
    assert [r[4] for r in rows if r[0] in ("| parity", "| peers", "| async-tp")] == [
        "needs >= 2 GPUs; this machine has 1 |"] * 3
    fp8 = {r[1]: r for r in rows if r[0] == "| fp8"}  # bf16 and emulated fp8, each planned
    assert set(fp8) == {"tokens/s bf16", "tokens/s fp8", "MFU bf16 / fp8 (of the bf16 peak)"}
    assert all(r[3].endswith("planned") for r in fp8.values())


def test_gpu_check_budget_skips_the_rest(capsys):
    gpu_check.main(["--device", "cpu", "--smoke", "--in-process", "--budget-s", "0",
                    "--sections", "throughput,parity"])
    text = capsys.readouterr().out
    assert text.count("skipped: 0 s of --budget-s left") == 2, text


def test_presets_by_device_name():
    assert gpu_check.preset_for("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert gpu_check.preset_for("NVIDIA H200") == "h200"
    assert gpu_check.preset_for("NVIDIA B200") == "b200"
    assert gpu_check.preset_for("NVIDIA GeForce RTX 4090") is None
