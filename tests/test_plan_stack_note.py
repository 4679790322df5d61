"""`plait plan` says in its first lines which kernel stack its MFUs assume (fused
kernels), and prints the best layout's figure under a torchtitan-like stack beside it
(plait/plan/stack_note.py)."""

import json
import re

from helpers import plan_cli

PLAN = ("--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--global-batch", "64")
LINE = re.compile(r"kernel stack: fused .*?MFU ([\d.]+)%\); a torchtitan-like stack .*?"
                  r"on the same layout: ([\d.]+) s, MFU ([\d.]+)%", re.S)


def test_the_plan_names_its_stack_and_the_torchtitan_like_figure_first():
    code, out = plan_cli(*PLAN)
    assert code == 0
    head = " ".join(line.strip() for line in out.splitlines()[:6])
    m = LINE.search(head)
    assert m, head
    fused_mfu, eager_s, eager_mfu = float(m[1]), float(m[2]), float(m[3])
    # the figure is the best layout's own plan under those flags
    code, js = plan_cli(*PLAN, "--json")
    best = json.loads(js)["layouts"][0]
    lay = ",".join(f"{k}={v}" for k, v in best["layout"].items() if v != 1) or "dp=1"
    code, js = plan_cli(*PLAN, "--layout", lay, "--micro-batch-size", str(best["microbatch"]),
                        "--zero", str(best["zero"]), "--recompute", best["recompute"],
                        "--fused-kernels", "no", "--attention-kernel", "fa2", "--json")
    assert code == 0, js
    eager = json.loads(js)["layouts"][0]
    assert eager_s == round(eager["step_time_s"], 3)
    assert eager_mfu == round(100 * eager["mfu"], 1)
    assert fused_mfu == round(100 * best["mfu"], 1) > eager_mfu


def test_an_eager_plan_says_so_and_a_profile_plan_names_no_stack():
    _, out = plan_cli(*PLAN, "--fused-kernels", "no")
    assert "kernel stack: PyTorch eager" in out and "torchtitan-like" not in out
    _, out = plan_cli(*PLAN, "--efficiency", "fitted")
    assert "kernel stack" not in out
