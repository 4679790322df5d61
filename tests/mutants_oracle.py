"""Mutants for the oracle's former holes (tests/mutants.py runs them): regional compilation
computing with stale weights, hierarchical context parallel's groups, DCP export's names,
DCP's stacked experts' axis order and its naming detection, the expert capacity drop,
token dispatch's gates, the non-finite skip, checkpoints' keep order and commit marker,
Muon's (per-shard orthogonalisation, the scale, Nesterov, the rule, the momentum on
resume), the overlapped F&B
pair's (the other micro-batch read, the wrong handle waited, the sides never interleaved),
and fault tolerance's
row mapping and launcher. The last two are caught by a process-tree test: the launched
interpreters apply the mutant through tests/mutant_site/sitecustomize.py."""

from __future__ import annotations

import math

from tests.mutant_kit import Mutant, _Namespace


def compile_freezes_first_weights():
    """--compile's graphs compute with the weights they first saw (parameters folded in
    as constants, as inductor's freezing does): a ZeRO-3 block's forward reads the first
    step's gathered weights ever after; gradients still reach the live ones."""
    from torch.nn.utils.stateless import _reparametrize_module

    from plait.model.transformer import Block
    from plait.parallel import compile as regional
    from plait.parallel import parallelize

    def frozen(stages, backend="inductor"):
        stages = list(stages)
        n = regional.compile_blocks(stages, backend)
        blocks = {id(m): m for stage in stages for m in stage.modules() if isinstance(m, Block)}
        for block in blocks.values():
            compiled, first = block.forward, {}

            def forward(*args, _block=block, _compiled=compiled, _first=first, **kwargs):
                live = dict(_block.named_parameters())
                if not _first:
                    _first.update({k: p.detach().clone() for k, p in live.items()})
                stale = {k: p + (_first[k] - p).detach() for k, p in live.items()}
                with _reparametrize_module(_block, stale):
                    return _compiled(*args, **kwargs)

            block.forward = forward
        return n

    parallelize.compile_blocks = frozen


def hierarchy_groups_transposed():
    """The all-to-all groups take the ranks at one place of each run, the ring the runs."""
    import torch.distributed as dist

    from plait.parallel import context, context_a2a

    def transposed(mesh, dim, degree):
        whole = sorted({tuple(mesh.ranks_along(dim, r)) for r in range(mesh.world_size)})
        for name, pick in ((context_a2a.INNER, 1), (context_a2a.OUTER, 0)):
            for w in whole:
                runs = [list(w[i:i + degree]) for i in range(0, len(w), degree)]
                cols = [list(c) for c in zip(*runs, strict=True)]
                for ranks in (runs, cols)[pick]:
                    group = dist.new_group(ranks) if len(ranks) > 1 else None
                    if mesh.rank in ranks:
                        mesh.group_ranks[name], mesh.groups[name] = ranks, group

    context_a2a.add_hierarchy_groups = transposed
    context.add_hierarchy_groups = transposed


def dcp_export_w1_w3_swapped():
    """plait export dcp: writes the MLP's gate projection under the up projection's name."""
    from plait.checkpoint import dcp

    names = dcp.export_names

    def swapped(m, naming="2026"):
        out = names(m, naming)
        for theirs in list(out):
            if theirs.endswith("feed_forward.w1.weight"):
                other = theirs.replace(".w1.", ".w3.")
                out[theirs], out[other] = out[other], out[theirs]
        return out

    dcp.export_names = swapped


def dcp_expert_stack_transposed():
    """plait export dcp: writes each stacked expert weight with its last two axes swapped
    (w1 and w3 as E x D x F, w2 as E x F x D: the older grouped-matmul layout)."""
    from plait.checkpoint import dcp, dcp_export

    names, write = dcp.export_names, dcp_export.write_dcp

    def transposed_names(m, naming="2026"):
        out = names(m, naming)
        for theirs, (ours, shape) in out.items():
            if ".mlp.experts." in ours:
                out[theirs] = (ours, (shape[0], shape[2], shape[1]))
        return out

    def write_transposed(src, out, dtype, naming="2026"):
        load = src.load
        src.load = lambda n: load(n).transpose(1, 2) if ".mlp.experts." in n else load(n)
        return write(src, out, dtype, naming)

    dcp.export_names, dcp_export.write_dcp = transposed_names, write_transposed


def dcp_2025_read_as_2026():
    """--init-from dcp: takes every checkpoint for torchtitan's 2026 naming: a 2025 name
    is looked for under its 2026 name (attention.wq as attention.qkv_linear.wq)."""
    from plait.checkpoint import dcp

    dcp.detect = lambda keys, m: "2026"


def capacity_one_past():
    """An expert keeps C + 1 assignments of a sequence, not C."""
    import torch.nn.functional as F

    from plait.model.moe import MoE

    def keep(self, chosen, seq_counts):
        if self.capacity_factor is None:
            return None
        length = int(seq_counts[0].sum()) // self.k
        cap = math.ceil(self.capacity_factor * length * self.k / self.n)
        onehot = F.one_hot(chosen, self.n)
        position = (onehot.cumsum(1) * onehot).sum(-1) - 1
        return (position <= cap).reshape(-1)

    MoE._capacity_keep = keep


def token_dispatch_gates_dropped():
    """Token dispatch: the destination sums a token's expert outputs without its gates."""
    import torch

    from plait.parallel.expert import AllToAllDispatch

    by_token = AllToAllDispatch._by_token

    def ungated(self, flat, slots, gates, counts, experts, k):
        return by_token(self, flat, slots, torch.ones_like(gates), counts, experts, k)

    AllToAllDispatch._by_token = ungated


def nonfinite_step_applied():
    """A step whose global grad norm is not finite updates the weights anyway."""
    from plait.train import loop

    loop.math = _Namespace(math, isfinite=lambda x: True)


def keep_prunes_the_newest():
    """--keep K deletes the newest committed checkpoints, not the oldest."""
    import shutil

    from plait.checkpoint import writer

    def prune(root, keep):
        committed = [p for _, p, ok in writer.checkpoints(root) if ok]
        gone = committed[:max(len(committed) - keep, 0)]
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
        return gone

    writer.prune = prune


def commit_marker_ignored():
    """A step directory counts as a checkpoint without its COMMITTED marker."""
    from pathlib import Path

    from plait.checkpoint import format as ck_format
    from plait.checkpoint import reader

    def committed(path):
        return Path(path).is_dir()

    ck_format.is_committed = committed
    reader.is_committed = committed


def ft_rows_of_the_replica():
    """Fault tolerance: a replica trains its own rows for every slot it holds, a lost
    replica's slot included."""
    from plait.parallel.fault_tolerance import FaultTolerantReplicas

    def rows_of(self, slot):
        n = self.mesh.size("dp")
        return self.replica * n + self.mesh.coord("dp"), self.count * n

    FaultTolerantReplicas.rows_of = rows_of


def ft_launcher_rows_twice():
    """The replica launcher writes each committed step's metrics row twice (a redone step
    logged again)."""
    import json

    from plait.launch.replicas import ReplicaLauncher

    read = ReplicaLauncher._read_rows

    def twice(self):
        before = len(self.rows)
        read(self)
        if self.metrics is not None:
            for row in self.rows[before:]:
                self.metrics.write_line(json.dumps(row))

    ReplicaLauncher._read_rows = twice


def muon_orthogonalised_per_shard():
    """ZeRO's Muon: each rank's piece of a matrix orthogonalised on its own (rows of the
    matrix where the piece holds whole rows), not the gathered whole."""
    import torch

    from plait.muon import orthogonalise
    from plait.parallel import muon

    def per_piece(self, mine, gathered, n):
        out, at = [], 0
        pieces: list[list[torch.Tensor]] = [[] for _ in mine]
        for r in range(n):
            for i, m in enumerate(mine):
                size = m.piece(r)[1] - m.piece(r)[0]
                pieces[i].append(gathered[at:at + size])
                at += size
        for ps, m in zip(pieces, mine, strict=True):
            cols = m.shape[1]
            out.append(torch.cat([orthogonalise(p.view(-1, cols) if p.numel() % cols == 0
                                                else p.view(1, -1), self.settings.ns_dtype)
                                  .reshape(-1) for p in ps if p.numel()]))
        return out

    muon.ShardedMuon._orthogonalised = per_piece


def muon_original_scale_for_moonlight():
    """Muon's update scaled by the original sqrt(max(1, A / B)) under Moonlight's name."""
    import math

    from plait import muon
    from plait.parallel import muon as sharded

    def original(shape, form):
        return math.sqrt(max(1.0, shape[-2] / shape[-1]))

    muon.update_scale = sharded.update_scale = original


def muon_nesterov_dropped():
    """Muon orthogonalises the momentum itself, not the Nesterov look-ahead g + mu B."""
    from plait import muon, optim
    from plait.parallel import muon as sharded

    def plain_momentum(masters, grads, momenta, lr, momentum, weight_decay, scale, ns_dtype,
                       grad_scale=1.0, sliced=None):
        for master, grad, buf in zip(masters, grads, momenta, strict=True):
            buf.mul_(momentum).add_(grad.to(master.dtype) * grad_scale)
            master.mul_(1 - lr * weight_decay)
            master.add_(muon.orthogonalise(buf, ns_dtype),
                        alpha=-lr * muon.update_scale(master.shape, scale))

    def lookahead(self, m, rank, grad_scale):
        ahead = original(self, m, rank, grad_scale)  # updates the momentum
        u, (a, b) = m.unit, m.piece(rank)
        lo = m.start + a - u.lo
        return self.momentum[id(u)][lo:lo + b - a].clone() + 0 * ahead

    original = sharded.ShardedMuon._lookahead
    muon.muon_update = plain_momentum
    sharded.ShardedMuon._lookahead = lookahead
    optim.muon_update = plain_momentum


def muon_takes_the_embedding():
    """Muon's rule sends every 2-D weight to Muon: the embedding, the head and the router
    too (they should stay on AdamW)."""
    from plait import muon, optim
    from plait.parallel import muon as sharded

    def every_matrix(name, p):
        return p.ndim >= 2

    muon.is_muon_matrix = optim.is_muon_matrix = sharded.is_muon_matrix = every_matrix


def fb_pair_reads_the_other_microbatch():
    """In an overlapped F&B pair the forward reads the paired backward's micro-batch's
    tokens in place of its own."""
    from plait.parallel.pipeline import runtime

    original = runtime.PipelineRuntime._run_pair

    def swapped(self, i):
        f, b = self.actions[i], self.actions[i + 1]
        own = self._micro
        self._micro = [own[b.microbatch] if k == f.microbatch else t
                       for k, t in enumerate(own)]
        try:
            return original(self, i)
        finally:
            self._micro = own

    runtime.PipelineRuntime._run_pair = swapped


def fb_pair_never_hands_over():
    """The overlapped F&B executor finds no all-to-all seam: each pair runs its forward
    whole, then its backward (correct, and nothing overlapped)."""
    from plait.parallel.pipeline import fb_overlap

    original = fb_overlap.FBPair.__init__

    def without_seams(self, stages, device):
        original(self, stages, device)
        self.seams = []

    fb_overlap.FBPair.__init__ = without_seams


def muon_tp_slices_alone():
    """Tensor parallel's Muon: each rank orthogonalises its own slice of a cut matrix."""
    from plait.muon import orthogonalise
    from plait.parallel import muon_tp

    def alone(self, looks, dtype):
        return [orthogonalise(x, dtype) for x in looks]

    muon_tp._Selected.orthogonalise = alone


def muon_momentum_not_restored():
    """A resumed Muon run starts each matrix's momentum from zero (masters and AdamW's
    moments loaded as saved)."""
    from plait.muon import is_muon_matrix
    from plait.parallel.replicated import ReplicatedOptimizer
    from plait.parallel.zero import ZeroOptimizer

    def replicated(self, steps, _load=ReplicatedOptimizer.finish_load):
        _load(self, steps)
        for buf in self.optim.momentum:
            buf.zero_()

    def sharded(self, steps, _load=ZeroOptimizer.finish_load):
        _load(self, steps)
        for u in self.units if self.muon is not None else []:
            names = dict(zip(map(id, u.params), u.names, strict=True))
            for a, b, p in u.segments():
                if is_muon_matrix(names[id(p)], p):
                    u.exp_avg[a:b].zero_()

    ReplicatedOptimizer.finish_load = replicated
    ZeroOptimizer.finish_load = sharded


def fb_pair_waits_the_wrong_handle():
    """When a side of an overlapped F&B pair gets the turn back it waits for the other
    side's last all-to-all, not its own (its own is never completed)."""
    from plait.parallel.pipeline import fb_overlap

    def wrong(self, handle, backward):
        side, other = ("B", "F") if backward else ("F", "B")
        last = self.__dict__.setdefault("_last", {})
        last[side] = handle
        with self._cv:
            if self._running[other]:
                self._turn = other
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._turn == side)
        last.get(other, handle).wait()

    fb_overlap.FBPair._wait = wrong


CONTEXT_MODES = "tests/test_context_modes.py::"
EP = "tests/test_expert_parallel.py::"
FT = "tests/test_fault_tolerance.py::"
MUON = "tests/test_muon.py::test_muon_matches_the_reference_muon"
MUON_ZERO = "tests/test_muon_parity.py::test_muon_zero_parity_every_rank_and_the_momentum"

MUTANTS = [
    Mutant("compile-weights-frozen",
           "--compile's graphs keep the first step's (ZeRO-3-gathered) weights",
           compile_freezes_first_weights,
           ["tests/test_compile.py::test_compiled_blocks_parity_and_one_graph_a_block_kind"]),
    Mutant("cp-hierarchy-groups-transposed",
           "hierarchical context parallel: all-to-all across the runs, the ring inside them",
           hierarchy_groups_transposed,
           [CONTEXT_MODES + "test_hierarchical_all_to_all_pairs_and_ring_across"]),
    Mutant("dcp-export-w1-w3-swapped", "DCP export names the gate projection as the up one",
           dcp_export_w1_w3_swapped,
           ["tests/test_dcp.py::test_plait_export_read_by_dcp_into_fsdp2"]),
    Mutant("dcp-expert-stack-transposed",
           "DCP export writes the stacked experts' last two axes swapped (E x D x F for w1)",
           dcp_expert_stack_transposed,
           ["tests/test_dcp_moe.py::test_plait_export_loads_into_fsdp2_deepseek"]),
    Mutant("dcp-2025-read-as-2026",
           "--init-from dcp: reads a 2025-named checkpoint under the 2026 names",
           dcp_2025_read_as_2026,
           ["tests/test_dcp.py::test_a_2025_checkpoint_is_read_as_the_2026_one"]),
    Mutant("moe-capacity-one-past", "an expert keeps one assignment past its capacity",
           capacity_one_past,
           [EP + "test_capacity_keeps_the_first_tokens_of_each_expert_per_sequence"]),
    Mutant("ep-token-dispatch-ungated", "token dispatch sums expert outputs without gates",
           token_dispatch_gates_dropped,
           [EP + "test_parity[dp=4,ep=4,ep_dispatch=token]"]),
    Mutant("nonfinite-step-applied", "a non-finite grad norm's update is applied anyway",
           nonfinite_step_applied,
           ["tests/test_nonfinite.py::"
            "test_one_nonfinite_step_is_skipped_everywhere_and_resume_counts_updates"]),
    Mutant("ckpt-keep-prunes-newest", "--keep deletes the newest checkpoints",
           keep_prunes_the_newest,
           ["tests/test_checkpoint_atomic.py::"
            "test_keep_deletes_old_checkpoints_only_after_the_new_commit"]),
    Mutant("ckpt-commit-marker-ignored", "an uncommitted step directory is resumed from",
           commit_marker_ignored,
           ["tests/test_checkpoint.py::test_killed_run_resumes_from_latest_complete"]),
    Mutant("ft-rows-of-the-replica", "fault tolerance: a slot's rows taken by replica index",
           ft_rows_of_the_replica,
           [FT + "test_a_lost_replica_costs_no_step_and_keeps_parity[zero2-killed]"]),
    Mutant("ft-launcher-rows-twice", "the replica launcher writes a step's row twice",
           ft_launcher_rows_twice,
           [FT + "test_a_lost_replica_costs_no_step_and_keeps_parity[zero2-killed]"]),
    Mutant("muon-orthogonalised-per-shard",
           "ZeRO's Muon orthogonalises each rank's piece of a matrix, not the whole",
           muon_orthogonalised_per_shard, [MUON_ZERO + "[layout0]"]),
    Mutant("muon-wrong-scale", "Muon's update takes the original scale under Moonlight's",
           muon_original_scale_for_moonlight, [MUON + "[tiny-moonlight]"]),
    Mutant("muon-nesterov-dropped", "Muon orthogonalises the momentum, not the look-ahead",
           muon_nesterov_dropped, [MUON + "[tiny-moonlight]", MUON_ZERO + "[layout0]"]),
    Mutant("muon-adamw-param-to-muon",
           "Muon takes the embedding, head and router (AdamW's) as its matrices",
           muon_takes_the_embedding, [MUON + "[tiny-moe-original]"]),
    Mutant("muon-tp-slices-alone", "tensor parallel's Muon orthogonalises each slice alone",
           muon_tp_slices_alone,
           ["tests/test_muon_parity.py::test_muon_tensor_parallel_parity[layout0]"]),
    Mutant("muon-momentum-not-restored", "a resumed Muon run starts its momentum from zero",
           muon_momentum_not_restored,
           ["tests/test_muon_checkpoint.py::"
            "test_muon_checkpoint_reshards_and_continues_within_parity[z1-single]",
            "tests/test_muon_checkpoint.py::"
            "test_muon_checkpoint_reshards_and_continues_within_parity[dp2-z3pp2]"]),
    Mutant("fb-pair-other-microbatch",
           "--overlap-fb: a pair's forward reads its backward's micro-batch",
           fb_pair_reads_the_other_microbatch,
           ["tests/test_matrix.py::test_row_equals_the_single_process_run["
            "dp2 z1 pp2:dualpipev moe ep2 ofb]"]),
    Mutant("fb-pair-wrong-handle",
           "--overlap-fb: a side waits for the other side's all-to-all, not its own",
           fb_pair_waits_the_wrong_handle,
           ["tests/test_fb_overlap.py::test_a_pairs_all_to_alls_are_issued_interleaved"]),
    Mutant("fb-pair-sequential", "--overlap-fb: a pair's sides run one after the other",
           fb_pair_never_hands_over,
           ["tests/test_fb_overlap.py::test_a_pairs_all_to_alls_are_issued_interleaved"]),
]
