"""Data parallel: the ranks of a `dp` group take different sequences of the global batch
and sum their gradients (plait/parallel/data.py), or with ZeRO shard the optimizer state,
the gradients and the parameters among themselves (plait/parallel/zero.py; Rajbhandari
et al. 2020). Its checks are the batch arithmetic (plait/config/checks.py)."""

from plait.dims.record import Dimension

DIMENSION = Dimension(
    name="dp", title="data parallel", strategy="plait.parallel.data", splits="batch",
    replicates_params=True, sums_loss=True, checkpoint="copies", color="#1f77b4",
    help="data-parallel size",
)
