"""Pipeline parallel: the ranks of a `pp` group hold consecutive stages of the layers and
pass activations forward and gradients back by point-to-point sends, in the order a
schedule lists (plait/schedule/; Huang et al. 2019, GPipe; Narayanan et al. 2021;
Qi et al. 2024, zero bubble). The loss is computed on the last stage."""

from __future__ import annotations

from plait.dims.record import Config, Dimension, ModelShape
from plait.schedule.registry import (
    SCHEDULES,
    natural_virtual_stages,
    validate_schedule_request,
)


def problems(cfg: Config) -> list[str]:
    """For pp > 1: the schedule's requests (the registry's rules), the layer split, and
    the combinations not built with a pipeline."""
    m, p = cfg.model, cfg.parallel
    if p.pp > m.n_layers:
        return [f"pp={p.pp} is more stages than model.n_layers={m.n_layers}; use "
                f"pp <= {m.n_layers}"]
    if p.pp == 1 or p.schedule not in SCHEDULES:
        return []
    v = natural_virtual_stages(p.schedule, p.virtual_stages)
    out = validate_schedule_request(p.schedule, p.pp, cfg.microbatches(), v,
                                    n_layers=m.n_layers)
    if m.tie_embeddings:
        out.append("model.tie_embeddings=true with pp>1: the embedding and the head "
                   "sit on different stages; set model.tie_embeddings=false")
    return out


def plan_sizes(sizes: list[int], shape: ModelShape, ranks_per_node: int) -> list[int]:
    """The planner's pp: at most a stage per layer (its schedule's rules are the search's,
    plait/plan/search.py)."""
    return [p for p in sizes if p <= shape.layers]


DIMENSION = Dimension(
    name="pp", title="pipeline parallel", strategy="plait.parallel.pipeline.runtime",
    splits="layers", sums_loss=True, checkpoint="owned", color="#9467bd",
    help="pipeline stages", problems=problems, plan_sizes=plan_sizes,
)
