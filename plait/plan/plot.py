"""`plait plan --plot`: the memory breakdown of the shown layouts, one bar each."""

from __future__ import annotations

import numpy as np

from plait.files import write_png
from plait.plan.estimate import Estimate
from plait.plan.hardware import GB


def plot_memory(path: str, ests: list[Estimate]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(ests) + 3, 4))
    bottom = np.zeros(len(ests))
    for k in ests[0].memory:
        vals = np.array([float(e.memory[k]) / GB for e in ests])
        ax.bar(range(len(ests)), vals, bottom=bottom, label=k)
        bottom += vals
    ax.set_xticks(range(len(ests)), [f"{e.layout.label()}\n{e.layout.schedule} "
                                     f"Z{e.layout.zero} {e.layout.recompute}" for e in ests],
                  fontsize=7)
    ax.set_ylabel("GB per rank")
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_png(fig, path, dpi=120)
    plt.close(fig)
