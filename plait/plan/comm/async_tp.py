"""Async tensor parallel's exposed time (plait/parallel/async_tp.py, docs/async_tp.md).

Each of sequence parallel's all-gathers and reduce-scatters runs as t - 1 ring hops, each
beside the partial matmul of one chunk (Wang et al. 2023, "Overlap communication with
dependent computation via decomposition in large deep learning models", ASPLOS, section
3): what a hop does not hide behind its chunk's matmul is exposed. A layer's forward has
two entry/exit pairs (attention's, the MLP's); beside each, half the layer's forward
GEMMs (attention's projections, or the MLP's three) split into t chunks, of which t - 1
run beside a hop. `overlap` is the share of a collective that compute beside it hides
(`Efficiency.comm_overlap`: 1 on a GPU, whose copy engines and links run beside the SMs).
"""

from __future__ import annotations

from typing import Any

import numpy as np

Num = Any


def async_tp_exposed(t_pair: Num, gemm_layer_fwd: Num, tp: Num, overlap: float) -> Num:
    """Exposed seconds of one all-gather + reduce-scatter pair (`t_pair`, as priced) when
    the rings overlap half a layer's forward GEMMs (`gemm_layer_fwd`)."""
    tp = np.maximum(tp, 1)
    hidden = overlap * (gemm_layer_fwd / 2) * (tp - 1) / tp
    return np.maximum(t_pair - hidden, 0.0)
