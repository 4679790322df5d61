"""The planner's communication model: every collective a layout's step issues, what one
call costs and how much of it the compute hides.

  price.py   one call's time (alpha-beta, Hockney: ring and tree all-reduce, all-gather,
             reduce-scatter, all-to-all, p2p), the link a group uses (`intra_node`,
             `order_strides`: the mesh order) and the `Collective` record every list holds
  layer.py   the collectives inside a layer, per micro-batch (tensor, context and expert
             parallel) and their exposed time
  step.py    the collectives around the layers (the pipeline's sends, the gradient sync
             over the replicas, the step's closing all-reduces) and their exposed time
  zero.py    how many reduce-scatters and all-gathers ZeRO issues a step (ZeRO-3's by
             pipeline stage: whole and split backwards, `parallel.zero3_gather`)
  sync.py    a measured profile's waits at blocking collectives (the GPU presets: none)
  rank.py    one pipeline rank's list, from the runtime's own partition (a dry run's and
             `plait report`'s comparison with the ledger)

Which collective of which dimension is priced where (`Collective.dim` names the group;
"edp": the ranks holding the same routed experts, "world": every rank; hybrid
sharding's groups, plait/dims/dp_replicate.py: "dp_shard", the replicas ZeRO shards
over, "edp_shard" the experts' copies in it, "dp_replicate" the copies of a shard):

  dim    collective                             priced in (module.function)  step-time line
  tp     2 all-reduces a layer forward, 2       layer.layer_comm             tp comm
         backward, replayed under recompute                                  (exposed)
         (Megatron's count; the runtime's list:
         layer.tp_collectives)
  cp     ring: K/V p2p hops, cp-1 forward,      layer._cp_exposure           cp/ep comm
         2(cp-1) backward, behind each block's                               (exposed)
         attention; allgather: K/V all-gather
         forward, dK/dV reduce-scatter
         backward, exposed
  ep     all-to-all dispatch + combine, forward layer._ep_exposure           cp/ep comm
         and backward (DualPipe: behind the                                  (exposed)
         paired micro-batch's compute)
  pp     a send per stage boundary crossed,     step.pp_p2p                  pipeline bubble
         forward and backward                                                + p2p (simulated)
  pp     DualPipe's swap of its copies'         step.dualpipe_copies         listed, not timed
         gradients
  dp     ZeRO-0 all-reduce; ZeRO-1/2 reduce-    step.dp_exposed_time         dp comm
  (dp_   scatter + all-gather; ZeRO-3 all-                                   (exposed)
  cp)    gather forward and backward + reduce-
         scatter: the dense parameters'
         gradients over the replicas (dp_cp:
         the dp x cp ranks, under context
         parallel; the mesh's name)
  edp    the same for the routed experts        step.dp_exposed_time         dp comm (exp.)
  dp_    hybrid sharding: ZeRO's as above,      step.dp_exposed_time         dp comm
  shard  inside a shard group of replicas                                    (exposed)
  (edp_  (edp_shard: the routed experts')
  shard)
  dp_    hybrid sharding: each reduced          step.shard_copies_sync       dp comm
  repli- gradient shard all-reduced over its                                 (exposed)
  cate   copies, once a step
  world  the grad norm's all-reduce (8 bytes)   step.step_end_collectives    dp comm (exp.)
  pp,    the logged loss's all-reduces (8       step.step_end_collectives    dp comm (exp.)
  cp, dp bytes each)
  any    the wait for the last rank, the extra  sync.sync_seconds            collective sync
         after it (a measured profile)                                       (waits)

The step-end all-reduces are priced under a measured profile only (`Efficiency.
runtime_comm`), as is the runtime's tp list instead of Megatron's count.

The step-time lines of the collectives' exposed time (`EXPOSED_TERMS`) and the dimensions
whose collectives run inside every layer (`PER_LAYER_DIMS`) are named here, for the step
time (plait/plan/estimate.py) and the shared-cores model (plait/plan/host_share.py). This
package imports nothing at import time: its modules import the planner's types.
"""

EXCHANGE_TERM = "cp/ep comm (exposed)"  # layer.py: the K/V exchange and the all-to-alls
# each step-time line of exposed communication and the dimensions whose collectives it is
EXPOSED_TERMS: dict[str, tuple[str, ...]] = {"tp comm (exposed)": ("tp",),
                                             EXCHANGE_TERM: ("cp", "ep"),
                                             "dp comm (exposed)": ("dp", "dp_cp",
                                                                   "dp_shard",
                                                                   "dp_replicate")}
# dimensions with collectives inside every layer (layer.py): ranks that share one group of
# them wait for each other at every layer
PER_LAYER_DIMS = ("tp", "cp", "ep")
