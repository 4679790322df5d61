"""`plait plan --explain`: the terms of one layout's step time, each with the numbers it
is made of, so a user can see why the plan predicts what it does."""

from __future__ import annotations

import numpy as np

from plait.plan import fp8, overlap_slowdown, zero3_gpu
from plait.plan.basis import Training, basis_of
from plait.plan.compute import Efficiency, attention_eff, gemm_eff, layer_gemms
from plait.plan.estimate import MEMORY_BOUND_TERM, Estimate
from plait.plan.hardware import Cluster
from plait.plan.memory_bound import achievable_bw, layer_kernels, priced
from plait.plan.shape import Shape
from plait.plan.stack import pp_overlapped


def _gemm_lines(shape: Shape, cluster: Cluster, train: Training, e: Estimate,
                eff: Efficiency) -> list[str]:
    b = basis_of(shape, cluster, train, e.layout, eff)
    tokens = float(b.tokens)
    parts = []
    rate = fp8.weight_gemms(train.precision, cluster.gpu, eff, 1.0)  # float8's curve
    curve, which = (rate[0], " of the float8 peak") if rate else (eff, "")
    for name, flops in layer_gemms(shape, tokens, b.tp, b.moe_split):
        f = float(np.asarray(flops))
        parts.append(f"{name} {f / 1e9:,.1f} GFLOP at {float(gemm_eff(f, curve)):.0%}{which}")
    if eff.attention_curve and e.layout.attention == "flash":
        att = f"fused attention {float(attention_eff(shape.seq, eff.attention_curve)):.0%} " \
              f"of peak at seq {shape.seq}"
    else:
        att = "attention core on the GEMM curve"
    return [f"  compute {float(e.time['compute']):.3f} s: per layer and micro-batch "
            f"({tokens:,.0f} tokens a rank) the forward GEMMs " + "; ".join(parts)
            + f" (backward: twice each); {att}; {float(e.hardware_tflops):,.0f} TFLOP/s "
            "hardware FLOPs a GPU over the whole step."]


def _memory_bound_lines(shape: Shape, cluster: Cluster, train: Training, e: Estimate,
                        eff: Efficiency) -> list[str]:
    """Each memory-bound kernel's bytes a layer and micro-batch (published GPU numbers)."""
    if not priced(eff):
        return []
    b = basis_of(shape, cluster, train, e.layout, eff)
    kernels = layer_kernels(shape, b.tokens, b.tp, e.layout.sp, b.e, e.layout.attention,
                            b.moe_split)
    if fp8.is_fp8(train.precision):
        kernels.append(fp8.cast_kernel(shape, b.tokens, b.tp, b.e, e.layout.zero,
                                       bool(train.fp8_block)))
    fused = train.stack.fused_kernels
    parts = [f"{k.name} {float(np.asarray(k.bytes(fused)[0])) / 1e6:,.0f} + "
             f"{float(np.asarray(k.bytes(fused)[1])) / 1e6:,.0f} MB" for k in kernels]
    stack = "fused" if fused else "eager (operator by operator)"
    return [f"    per layer and micro-batch, forward + backward: {'; '.join(parts)}; at "
            f"{achievable_bw(cluster.gpu, eff) / 1e9:,.0f} GB/s, launches {stack} "
            f"(--fused-kernels) at {eff.launch_seconds * 1e6:.0f} us each where they bound "
            "a pass; the loss and the optimizer step counted the same way."]


def _comm_lines(e: Estimate) -> list[str]:
    out = []
    for c in e.collectives:
        if float(np.asarray(c.total)) <= 0:
            continue
        t_each = float(np.asarray(c.time_each))
        size = float(np.asarray(c.size))
        link = "NVLink" if bool(np.asarray(c.intra)) else "inter-node"
        bw = size / t_each / 1e9 if t_each > 0 else 0.0
        out.append(f"  {c.dim} {c.op}: {float(np.asarray(c.count)):,.0f} x {size / 1e6:,.1f} MB "
                   f"over {int(np.asarray(c.group))} ranks ({link}), {t_each * 1e3:.3f} ms each "
                   f"({bw:,.0f} GB/s of payload), exposed {float(np.asarray(c.exposed)):.3f} s "
                   f"({c.overlap})")
    return out


def explain_terms(shape: Shape, cluster: Cluster, train: Training, e: Estimate,
                  eff: Efficiency) -> list[str]:
    """The lines `--explain` prints for estimate `e`."""
    st = train.stack
    lines = [f"Why {e.layout.label()} takes {float(e.step_time):.3f} s a step "
             f"(MFU {float(e.mfu):.1%}):"]
    lines += _gemm_lines(shape, cluster, train, e, eff)
    for k, v in e.time.items():
        if k != "compute":
            lines.append(f"  {k}: {float(v):.3f} s")
            if k == MEMORY_BOUND_TERM:
                lines += _memory_bound_lines(shape, cluster, train, e, eff)
            if k == overlap_slowdown.TERM:
                hidden = float(np.asarray(overlap_slowdown.hidden_seconds(e.collectives)))
                lines.append(f"    {hidden:.3f} s of collectives hidden behind compute, which "
                             f"runs {eff.overlap_slowdown:.1%} slower beside them "
                             "(arXiv:2507.03114's mean).")
            if k == zero3_gpu.COPIES_TERM:
                bw = achievable_bw(cluster.gpu, eff)
                lines.append(f"    {float(v) * bw / 1e9:,.1f} GB a step at {bw / 1e9:,.0f} GB/s: "
                             "each all-gather's copy-in (the fp32 shard cast) and copy-out, "
                             "each reduce-scatter's copy-in (the gradient in the reduce "
                             "dtype) and its shard's division and fp32 accumulation.")
    sends = "overlapped" if pp_overlapped(st, e.layout.schedule) else "on the critical path"
    rings = "ring hops beside their matmuls" if e.layout.async_tp else "on the critical path"
    lines.append(f"  assumed: data-parallel reduction {'overlaps' if st.dp_overlap else 'after'}"
                 f" the backward (--dp-overlap); pipeline sends {sends} (--pp-overlap); "
                 f"sequence parallel's collectives {rings} (--async-tp); "
                 f"bubble {float(e.bubble_fraction):.1%}.")
    return lines + _comm_lines(e)
