"""Mutants of the parallel machinery (tensor/sequence parallel regions, the vocab-parallel
loss, expert parallel and MoE balancing, ZeRO): patches and the tests that must catch them.
tests/mutants.py adds `MUTANTS` to its own list."""

from __future__ import annotations

from tests.mutant_kit import Mutant

# ---- tensor and sequence parallel ----------------------------------------------------------


def tp_copy_backward_not_reduced():
    from plait.comm import autograd

    def identity(ctx, g):  # f's adjoint taken as the identity, like g's
        return g, None, None, None

    # torch looks the backward up on the Function class at each call
    autograd._CopyToTP.backward = staticmethod(identity)


def sp_scatter_along_batch():
    from plait.comm import autograd

    gather, reduce_scatter, chunk = autograd._gather_seq, autograd._reduce_scatter_seq, \
        autograd._my_chunk

    # Megatron's (seq, batch, hidden) convention in plait's (batch, seq, hidden) layout: every
    # SP split, gather and reduce-scatter works on axis 0, the batch
    autograd._gather_seq = lambda x, mesh, dim, seq_dim, tag: gather(x, mesh, dim, 0, tag)
    autograd._reduce_scatter_seq = lambda x, mesh, dim, seq_dim, tag: reduce_scatter(
        x, mesh, dim, 0, tag)
    autograd._my_chunk = lambda x, mesh, dim, seq_dim: chunk(x, mesh, dim, 0)


def vocab_padding_in_softmax():
    from plait.parallel.tensor import _VocabParallelCE

    forward = _VocabParallelCE.forward

    def unmasked(ctx, logits, targets, mesh, start, valid):
        # every local column counted: the padding rows' logits join the max and the sum
        return forward(ctx, logits, targets, mesh, start, logits.shape[-1])

    _VocabParallelCE.forward = staticmethod(unmasked)


def mla_down_projections_not_summed():
    from plait.parallel import tensor

    plan = tensor.mla_plan

    def no_sum(cfg):  # the down-projections and latent norms kept without their all-reduce
        return {k: v for k, v in plan(cfg).items() if v != "sequence"}

    tensor.mla_plan = no_sum


# ---- context parallel's all-to-all modes ----------------------------------------------------


def a2a_kv_heads_tiled():
    from plait.parallel import context_a2a

    # the KV heads repeated as a block (h0 h1 h0 h1), not each in place (h0 h0 h1 h1): after
    # the head split a rank's query heads meet another group's KV head
    context_a2a.repeat_kv = lambda t, rep: t if rep == 1 else t.repeat(1, rep, 1, 1)


def a2a_rank_order_as_sequence():
    from plait.parallel import context

    init = context.ContextParallelAttention.__init__

    def no_reorder(self, *args, **kwargs):  # zigzag's gathered chunks taken as in order
        init(self, *args, **kwargs)
        self.order = None

    context.ContextParallelAttention.__init__ = no_reorder


def documents_attention_crosses():
    from plait.model import packed
    from plait.parallel import context

    def causal_only(q_docs, k_docs, q_idx, k_idx):  # the documents' ids ignored
        keep = k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)
        return keep.expand(q_docs.shape[0], -1, -1).unsqueeze(1)

    packed.document_mask = causal_only
    context.document_mask = causal_only


def documents_ring_blocks_unmasked():
    from plait.parallel.context import Ring

    Ring.block_mask = lambda self, docs, i, src, j, causal, split=None: None  # docs forgotten


def documents_split_mirror_dropped():
    from plait.parallel import context_balance

    context_balance._mirror = lambda g, cp: g % cp  # chunk cp+r to rank r, not 2cp-1-g's


def documents_split_masked_by_chunks():
    import torch

    from plait.parallel.context import Ring

    def chunk_ids(self, split, pos, i):  # the zigzag chunk's indices, not the split's tokens
        c = self.layout.chunk_len
        start = self.chunks(pos)[i] * c
        return torch.arange(start, start + c).expand(split.shape[0], c)

    Ring.slot_ids = chunk_ids


# ---- expert parallel and MoE balancing -------------------------------------------------


def expert_major_untransposed():
    import torch

    from plait.parallel import expert

    def source_major(counts):  # the transposes of expert_major dropped: rows stay in
        flat = counts.reshape(-1)  # (source, expert) order, fed to the experts as if grouped
        starts = flat.cumsum(0) - flat
        lengths, first = flat, starts
        seg_start = lengths.cumsum(0) - lengths
        total = int(lengths.sum())
        within = torch.arange(total, device=counts.device) - seg_start.repeat_interleave(
            lengths)
        return first.repeat_interleave(lengths) + within

    expert.expert_major = source_major  # AllToAllDispatch reads the module's global


def expert_grads_over_dp():
    from plait.parallel import expert, replicated, zero_units

    def dense(placements, p, dense_dim):  # expert slices summed with the dense parameters
        return dense_dim

    expert.reduce_dim = dense
    replicated.reduce_dim = dense  # imported by name: the replicated optimizer's syncs
    zero_units.reduce_dim = dense  # imported by name: ZeRO's units


def moe_bias_sign_flipped():
    import torch

    from plait.parallel import expert
    from plait.train import loop

    finish = expert.finish_moe_step

    def flipped(stages, mesh, sp, update_bias):
        stages = list(stages)
        layers = expert.moe_layers(stages)
        before = [m.bias.clone() for _, m in layers]
        out = finish(stages, mesh, sp, update_bias)
        with torch.no_grad():  # b -= gamma * sign(mean - load): the busiest experts favoured
            for (_, m), b in zip(layers, before, strict=True):
                m.bias.copy_(2 * b - m.bias)
        return out

    expert.finish_moe_step = flipped
    loop.finish_moe_step = flipped  # imported by name: the training step's


def moe_load_not_over_cp():
    from plait.parallel import expert

    def dp_only(mesh, sp):  # written before context parallel split sequences: cp dropped
        return ["dp", *(["tp"] if sp else [])]

    expert.token_groups = dp_only


# ---- ZeRO --------------------------------------------------------------------------------


def zero3_gathered_kept_over_update():
    from plait.parallel.zero import ZeroOptimizer

    publish = ZeroOptimizer._publish

    def keep_gathered(self):
        if self.stage != 3:
            return publish(self)
        # the shards updated, but a unit gathered before the update (zero3_gather=step: by
        # the next step's forward prefix under post-validation) stays as it was, and the
        # step run again uses it
        for u in self.units:
            u.shard.copy_(u.master)
        return None

    ZeroOptimizer._publish = keep_gathered


def zero_copies_not_summed():
    from plait.parallel.zero import ZeroOptimizer

    ZeroOptimizer._sum_copies = lambda self: None  # each copy steps with its own gradient


def zero_padding_not_zeroed():
    from plait.parallel.zero_units import _Unit

    flat_grad = _Unit.flat_grad

    def stale_padding(self, free):
        flat = flat_grad(self, free)
        pad = flat.numel() - self.numel
        if pad:  # the padding keeps what the recycled buffer held (here: gradient values)
            flat[self.numel:] = flat[:pad]
        return flat

    _Unit.flat_grad = stale_padding


def hybrid_shards_not_summed():
    from plait.parallel.replicas.sync import EveryStep, InMesh

    # each shard group steps with its own replicas' gradient only
    EveryStep.gradients = InMesh.gradients


def fault_tolerance_lost_slots_dropped():
    from plait.parallel.fault_tolerance import SlotMap

    # a lost replica's slices of the global batch go to nobody: the step's gradient is
    # the survivors' slices only (the global batch shrinks with every loss)
    SlotMap.without = lambda self, lost, members: SlotMap(dict(self.owner))


def fault_tolerance_joiner_keeps_its_own_state():
    from plait.parallel import fault_tolerance

    # the replacement skips the hand-over: it trains on from its freshly built state
    fault_tolerance.comm.recv_on = lambda *args, **kwargs: None


def hybrid_norm_counts_copies():
    from plait.parallel.zero import ZeroOptimizer

    local_sq_norm = ZeroOptimizer.local_sq_norm

    def every_copy(self):  # each copy of a shard counted in the grad norm
        replicate, self.replicate = self.replicate, None
        try:
            return local_sq_norm(self)
        finally:
            self.replicate = replicate

    ZeroOptimizer.local_sq_norm = every_copy


def hybrid_shard_counted_by_its_name():
    from plait.parallel.zero import ZeroOptimizer

    local_sq_norm = ZeroOptimizer.local_sq_norm

    def by_name(self):  # the norm reads the shard group's own name, not the group it cuts
        kept = [u.reduced_over for u in self.units]
        for u in self.units:
            u.reduced_over = u.dim
        try:
            return local_sq_norm(self)
        finally:
            for u, over in zip(self.units, kept, strict=True):
                u.reduced_over = over

    ZeroOptimizer.local_sq_norm = by_name


def async_tp_chunks_misrouted():
    from plait.parallel import async_tp

    ring = async_tp.ring_reduce_scatter

    def shifted(partial, mesh, dim, **kw):
        # each hop carries the partial of the next rank's chunk: the ring's order off by one
        n = mesh.size(dim)
        return ring(lambda d: partial((d + 1) % n), mesh, dim, **kw)

    async_tp.ring_reduce_scatter = shifted


TP = "tests/test_tensor_parallel.py::"
EP = "tests/test_expert_parallel.py::"
CP = "tests/test_context_parallel.py::"
DOCS = "tests/test_documents.py::test_parity_with_each_document_run_alone"
ZERO = "tests/test_zero.py::"
ZPIPE = "tests/test_zero_pipeline.py::test_parity_with_the_single_process_run"
HYBRID = "tests/test_hybrid_sharding.py::test_parity_and_replicas_hold_the_same_shards"
FT = "tests/test_fault_tolerance.py::"

MUTANTS = [
    Mutant("tp-copy-backward-not-reduced", "copy_to_tp's backward skips the all-reduce",
           tp_copy_backward_not_reduced,
           [TP + "test_region_functions_and_their_adjoints",
            TP + "test_parity_padded_vocabulary"]),
    Mutant("sp-scatter-along-batch", "SP splits/gathers the batch axis, not the sequence",
           sp_scatter_along_batch, [TP + "test_region_functions_and_their_adjoints"]),
    Mutant("vocab-padding-in-softmax", "vocab-parallel CE counts the padding columns",
           vocab_padding_in_softmax,
           [TP + "test_vocab_parallel_loss_equals_full_cross_entropy[62]",
            TP + "test_parity_padded_vocabulary"]),
    Mutant("mla-down-projections-not-summed",
           "MLA under tp: each rank keeps its heads' part of the down-projections' gradient",
           mla_down_projections_not_summed,
           ["tests/test_matrix.py::test_row_equals_the_single_process_run"
            "[dp2 z3 tp2 sp mla rc]"]),
    Mutant("a2a-kv-heads-tiled", "Ulysses: KV heads repeated as a block, not each in place",
           a2a_kv_heads_tiled, [CP + "test_core_equals_full_causal_attention[4]"]),
    Mutant("a2a-rank-order-as-sequence",
           "Ulysses: the gathered zigzag chunks attended in rank order, not sequence order",
           a2a_rank_order_as_sequence,
           [CP + "test_core_equals_full_causal_attention[2]",
            "tests/test_matrix.py::test_row_equals_the_single_process_run"
            "[z3 tp2 sp cp2:a2a moe ep2]"]),
    Mutant("documents-attention-crosses", "packed documents: attention sees earlier documents",
           documents_attention_crosses,
           [DOCS + "[dp=2,tp=2,sp=true]", DOCS + "[cp=4,cp_mode=a2a]"]),
    Mutant("documents-ring-blocks-unmasked",
           "packed documents: ring attention's blocks ignore the documents",
           documents_ring_blocks_unmasked,
           [DOCS + "[cp=2,cp_mode=ring,pp=2,schedule=zb-v,recompute=full,n_layers=4,"
            "tie_embeddings=false]"]),
    Mutant("documents-split-mirror-dropped",
           "packed documents' cp split: rank r takes chunks r and cp+r, not 2cp-1-r",
           documents_split_mirror_dropped,
           ["tests/test_context_balance.py::"
            "test_document_split_balances_short_documents_where_zigzag_does_not"]),
    Mutant("documents-split-masked-by-chunks",
           "packed documents split by document: the ring masks blocks by the zigzag chunks",
           documents_split_masked_by_chunks,
           [DOCS + "[cp=2,cp_mode=ring,pp=2,schedule=zb-v,recompute=full,n_layers=4,"
            "tie_embeddings=false]"]),
    Mutant("expert-major-untransposed", "all-to-all rows fed to experts source-major",
           expert_major_untransposed,
           [EP + "test_expert_major_regroups_source_major_rows",
            EP + "test_parity[dp=2,ep=2]"]),
    Mutant("expert-grads-over-dp", "expert gradients summed over dp, not edp",
           expert_grads_over_dp, [EP + "test_parity[dp=2,ep=2]"]),
    Mutant("moe-bias-sign-flipped", "balancing bias raised for the overloaded experts",
           moe_bias_sign_flipped,
           [EP + "test_balancing_bias_moves_toward_underloaded_experts"]),
    Mutant("moe-load-not-over-cp", "balancing load not summed over cp ranks",
           moe_load_not_over_cp,
           [EP + "test_balancing_bias_sums_the_load_over_context_parallel_ranks"]),
    Mutant("zero3-gathered-kept-over-update",
           "ZeRO-3 unit gathered before the update, used after it",
           zero3_gathered_kept_over_update, [ZPIPE + "[z3 zb-h2 step post-validation]"]),
    Mutant("zero-copies-not-summed", "ZeRO under DualPipe: each copy's own gradient shard",
           zero_copies_not_summed, [ZPIPE + "[z2 dualpipe]"]),
    Mutant("hybrid-shards-not-summed", "hybrid sharding: shards not all-reduced over copies",
           hybrid_shards_not_summed, [HYBRID + "[3]"]),
    Mutant("hybrid-norm-counts-copies", "hybrid sharding: every copy of a shard in the norm",
           hybrid_norm_counts_copies, [HYBRID + "[1]"]),
    Mutant("hybrid-shard-counted-by-its-name",
           "hybrid sharding beside cp: a shard counted over dp_shard's name, not dp_cp",
           hybrid_shard_counted_by_its_name,
           ["tests/test_matrix.py::test_row_equals_the_single_process_run"
            "[dp2x2 z3 cp2:ring moe ep4]"]),
    Mutant("ft-lost-slots-dropped", "fault tolerance: a lost replica's micro-batches dropped",
           fault_tolerance_lost_slots_dropped,
           [FT + "test_a_silent_replica_is_left_out_and_its_slot_trained_by_a_survivor"]),
    Mutant("ft-joiner-keeps-its-own-state",
           "fault tolerance: a replacement trains on without the donor's state",
           fault_tolerance_joiner_keeps_its_own_state,
           [FT + "test_a_replacement_joins_with_the_donors_state_at_the_next_step"]),
    Mutant("async-tp-chunks-misrouted",
           "async TP's ring reduce-scatter sums each rank's neighbour's chunk",
           async_tp_chunks_misrouted,
           ["tests/test_async_tp.py::test_parity_and_ledger_bytes_with_zero3_split_backward_"
            "and_recompute"]),
    Mutant("zero-padding-not-zeroed", "ZeRO flat gradient's padding left unwritten",
           zero_padding_not_zeroed, [ZERO + "test_shard_padding_stays_zero"]),
]
