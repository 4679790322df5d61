"""Mutants of the pipeline, the training loop and resume (tests/mutants.py runs them): each
patch models one real bug in the code path it names; `MUTANTS` lists them with the
cheapest tests that catch them first."""

from __future__ import annotations

from tests.mutant_kit import Mutant, _Namespace

# ---- the patches ----------------------------------------------------------------------------


def recv_order_ignored():
    """Lowering places each receive just before its consumer, forgetting that transfers on
    one channel match in posting order: a receive then gets another micro-batch's (or
    another stage's) activation."""
    from plait.parallel.pipeline import runtime
    from plait.schedule import lower as lower_mod
    from plait.schedule.ir import Schedule, trusted

    def unordered(schedule: Schedule) -> Schedule:
        rank_of, p = schedule.stage_to_rank, schedule.pp
        computes = [list(acts) for acts in schedule.actions]
        where: dict[str, dict[tuple[int, int], int]] = {"F": {}, "I": {}, "B": {}}
        for acts in computes:
            for i, (kind, stage, mb, _) in enumerate(acts):
                if kind != "W":
                    where[kind][(stage, mb)] = i
        sends_after = [{} for _ in range(p)]
        recvs_before = [{} for _ in range(p)]
        for a_rank, acts in enumerate(computes):
            for i, (kind, stage, mb, _) in enumerate(acts):
                if kind == "W":
                    continue
                fwd = kind == "F"
                dst = schedule.next_stage(stage) if fwd else schedule.prev_stage(stage)
                if dst is None or rank_of[dst] == a_rank:
                    continue
                b_rank = rank_of[dst]
                sends_after[a_rank].setdefault(i, []).append(
                    trusted("SEND_F" if fwd else "SEND_B", stage, mb, b_rank))
                consumer = where["F"][dst, mb] if fwd else where["I"].get(
                    (dst, mb), where["B"].get((dst, mb)))
                recvs_before[b_rank].setdefault(max(consumer - lower_mod.LOOKAHEAD, 0), []
                                                ).append(trusted("RECV_F" if fwd else "RECV_B",
                                                                 dst, mb, a_rank))
        lowered = []
        for r, acts in enumerate(computes):
            seq = []
            for i, act in enumerate(acts):
                seq += recvs_before[r].get(i, [])
                seq.append(act)
                seq += sends_after[r].get(i, [])
            lowered.append(seq)
        return Schedule(schedule.name, schedule.pp, schedule.microbatches,
                        schedule.virtual_stages, schedule.num_stages,
                        list(schedule.stage_to_rank), lowered, schedule.num_chains,
                        lowered=True)

    lower_mod.lower = unordered
    runtime.lower = unordered  # imported by name: the runtime lowers what it runs


def zb_last_w_dropped():
    from plait.schedule import schedules
    from plait.schedule.ir import trusted

    def split_1f1b(name, p, m, warm, w_delay):  # schedules._split_1f1b, one W short
        acts = []
        for r in range(p):
            w = min(warm(r), m)
            seq = [trusted("F", r, i) for i in range(w)]
            next_w = 0
            for k in range(m):
                if w + k < m:
                    seq.append(trusted("F", r, w + k))
                seq.append(trusted("I", r, k))
                if k >= w_delay(r):
                    seq.append(trusted("W", r, next_w))
                    next_w += 1
            seq += [trusted("W", r, i) for i in range(next_w, m - 1)]  # the tail's last lost
            acts.append(seq)
        return schedules._linear(name, p, m, acts)

    schedules._split_1f1b = split_1f1b  # zb-h1 and zb-h2 build through it


def dualpipe_copies_not_summed():
    import torch

    from plait import comm
    from plait.parallel import replicated

    def swapped_not_added(stages, schedule, mesh, dim="pp"):
        if schedule.num_chains == 1:
            return
        me = mesh.coord(dim)
        mirror = mesh.group_ranks[dim][schedule.pp - 1 - me]
        order = sorted(stages, key=schedule.model_stage)
        params = [p for s in order for p in stages[s].parameters()]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])
        theirs = torch.empty_like(flat)
        for h in comm.batch_send_recv([(flat, mirror)], [(theirs, mirror)], mesh, dim,
                                      tag="pp_copies"):
            h.wait()
        # the mirror's gradient received, never added: each copy steps with its own
        del theirs

    replicated.sum_copy_gradients = swapped_not_added  # TwoCopyOptimizer calls it by name


def recompute_reads_a_stale_input():
    """The split backward's recomputation (inside I) reads the stage input from where the
    stage's latest forward left it: a later micro-batch's input, not this one's."""
    import torch

    from plait.parallel.pipeline.runtime import PipelineRuntime

    forward, again = PipelineRuntime._forward, PipelineRuntime._forward_again

    def remembered(self, s, mb, x, first, last):
        if not hasattr(self, "_latest"):
            self._latest = {}
        self._latest[s] = (mb, x.detach().clone())
        return forward(self, s, mb, x, first, last)

    def stale(self, s, mb, live, first, last):
        newer, x = self._latest[s]
        micro = self._micro
        if first:
            self._micro = list(micro)
            self._micro[mb] = micro[newer]  # recomputed from the newer micro-batch's tokens
        else:
            with torch.no_grad():
                live.x.copy_(x)  # the input buffer overwritten by the newer micro-batch
        try:
            again(self, s, mb, live, first, last)
        finally:
            self._micro = micro

    PipelineRuntime._forward = remembered
    PipelineRuntime._forward_again = stale


def grads_not_zeroed():
    from plait.parallel.replicated import ReplicatedOptimizer
    from plait.parallel.zero import ZeroOptimizer

    def kept(self):
        pass  # the next step's backward accumulates onto this step's gradients

    ReplicatedOptimizer.zero_grad = kept
    ZeroOptimizer.zero_grad = kept


def dp_rows_overlap():
    from plait.train.data import GlobalBatches

    def local_batch(self, step, dp_rank, dp_size):
        per = self.global_batch // dp_size
        return self.rows(step, dp_rank, dp_rank + per)  # offset by rank, not rank * per

    GlobalBatches.local_batch = local_batch


def lr_one_step_ahead():
    from plait.train import loop, lr_schedule

    lr_at = lr_schedule.lr_at

    def ahead(step, base_lr, warmup, total, min_ratio):
        return lr_at(step + 1, base_lr, warmup, total, min_ratio)

    lr_schedule.lr_at = ahead
    loop.lr_at = ahead  # imported by name: the loop's per-step learning rate


def resume_data_from_zero():
    """The loader counts the steps this process ran, not the global step: a resumed run
    reads step 0's batch again."""
    from plait.train import loop

    train = loop.train

    def restarted(cfg, mesh, batches, options=None):
        options = options if options is not None else loop.TrainOptions()
        start, checkpoint = [0], options.checkpoint
        if checkpoint is not None:
            restore = checkpoint.restore

            def remembered(*a, **kw):
                start[0] = restore(*a, **kw)
                return start[0]

            checkpoint.restore = remembered

        class FromZero:
            def __getattr__(self, name):
                return getattr(batches, name)

            def local_batch(self, step, dp_rank, dp_size):
                return batches.local_batch(step - start[0], dp_rank, dp_size)

        return train(cfg, mesh, FromZero(), options)

    loop.train = restarted


def moe_bias_not_restored():
    from plait.checkpoint import pieces, reader

    every = pieces.pieces

    def without_bias(par, mesh, kind):  # the bias is saved, never read back
        biases = {id(p.tensor) for p in pieces.state_pieces(par, mesh)}
        return [p for p in every(par, mesh, kind) if id(p.tensor) not in biases]

    reader.pieces = without_bias  # imported by name: what a resume loads


def rollback_keeps_the_update():
    """A failed check redoes the update (clipped) without restoring the snapshot first:
    the optimistic update stays under the redone one."""
    from plait.parallel.post_validation import PostValidation

    validate = PostValidation.validate

    def not_restored(self):
        opt = self.opt
        self.opt = _Namespace(opt, restore=opt.drop_snapshot)
        try:
            return validate(self)
        finally:
            self.opt = opt

    PostValidation.validate = not_restored


# ---- the mutants ----------------------------------------------------------------------------

SCHED = "tests/test_schedules.py::test_schedule_is_valid_lowered_and_round_trips"
RUNTIME = "tests/test_pipeline_runtime.py::"
CKPT = "tests/test_checkpoint.py::test_resume_same_layout_is_bit_identical"
MOE_EP2 = ("model.n_experts=8+model.top_k=2+model.expert_ffn_dim=32+model.n_shared_experts=1+"
           "model.aux_loss_coef=0.01+model.bias_update_rate=0.01+parallel.dp=2+parallel.ep=2+"
           "parallel.zero=1")

def straggler_by_wait():
    from plait.train.stragglers import Stragglers

    judge = Stragglers.judge

    def by_wait(self, step, compute, wait):
        return judge(self, step, wait, compute)  # the rank that waits most: the fastest

    Stragglers.judge = by_wait


def straggler_mean_with_itself():
    from plait.train import stragglers

    def mean_of_everyone(values):  # the rank pulls its own reference up
        return [sum(values) / len(values) if len(values) > 1 else None] * len(values)

    stragglers.peer_medians = mean_of_everyone


def straggler_streak_kept():
    from plait.train import stragglers

    judge = stragglers.Stragglers.judge

    def kept(self, step, compute, wait):
        before = dict(self.streak)
        out = judge(self, step, compute, wait)
        for r, n in self.streak.items():
            if n == 0:  # a step that is not slow does not clear the count
                self.streak[r] = before.get(r, 0)
        return out

    stragglers.Stragglers.judge = kept


STRAGGLERS = "tests/test_stragglers.py::"

MUTANTS: list[Mutant] = [
    Mutant("pp-recv-order-ignored", "lowering ignores a channel's posting order: a receive "
           "gets another micro-batch's activation", recv_order_ignored,
           [SCHED + "[zb-v-2-4-2]",  # the checker sees the mismatch
            # the runtime: zb-v at pp2 m4, an activation received as a gradient
            "tests/test_recompute.py::test_recompute_parity[selective-zb-v-tp1]"]),
    Mutant("zb-last-w-dropped", "zb-h1/zb-h2 schedule drops the last deferred W",
           zb_last_w_dropped, [SCHED + "[zb-h1-2-2-1]", SCHED + "[zb-h2-2-2-1]"]),
    Mutant("dualpipe-copies-not-summed", "DualPipe: the mirror copy's gradient received, not "
           "added", dualpipe_copies_not_summed,
           [RUNTIME + "test_schedule_parity[dualpipe-4-8]"]),
    Mutant("recompute-stale-input", "split-backward recompute reads a later micro-batch's "
           "input", recompute_reads_a_stale_input,
           ["tests/test_recompute.py::test_recompute_parity[selective-zb-v-tp1]",
            "tests/test_recompute.py::test_recompute_parity[selective-dualpipev-tp1]"]),
    Mutant("grads-not-zeroed", "gradients not zeroed after the update (accumulate across "
           "steps)", grads_not_zeroed,
           ["tests/test_data_parallel.py::test_single_rank_plait_equals_reference",
            "tests/test_zero.py::test_parity_with_accumulation_and_clipping[1]"]),
    Mutant("dp-rows-overlap", "dp rank r reads rows r.. of the global batch, not r*B/dp..",
           dp_rows_overlap,
           ["tests/test_data.py::test_dp_slices_tile_the_global_batch",
            "tests/test_data_parallel.py::test_parity_with_accumulation_and_clipping[naive-2]"]),
    Mutant("lr-one-step-ahead", "the learning rate evaluated at step + 1", lr_one_step_ahead,
           ["tests/test_model.py::test_lr_at_table",
            "tests/test_data_parallel.py::test_single_rank_plait_equals_reference"]),
    Mutant("resume-data-from-zero", "a resume restarts the data at step 0",
           resume_data_from_zero,
           [CKPT + "[single]", CKPT + "[parallel.dp=2+parallel.zero=2]"]),
    Mutant("resume-moe-bias-lost", "a resume does not load the MoE balancing bias",
           moe_bias_not_restored, [CKPT + f"[{MOE_EP2}]"]),
    Mutant("rollback-keeps-update", "post-validation: a failed check redoes the update "
           "without restoring the snapshot", rollback_keeps_the_update,
           ["tests/test_post_validation.py::test_post_validation_rolls_back_exactly_on_every_"
            "zero_bubble_schedule",
            "tests/test_post_validation.py::test_post_validation_with_zero1_tp_cp_bf16_and_pp4"]),
    Mutant("straggler-by-wait", "stragglers judged by wait, not compute: the fastest rank "
           "named", straggler_by_wait,
           [STRAGGLERS + "test_the_slow_rank_is_named_within_a_few_steps_on_every_rank"]),
    Mutant("straggler-mean-with-itself", "a rank's compute compared with the mean of every "
           "rank, itself included", straggler_mean_with_itself,
           [STRAGGLERS + "test_both_margins_and_the_peers_median_without_the_rank_itself"]),
    Mutant("straggler-streak-kept", "a step that is not slow does not clear a rank's "
           "streak", straggler_streak_kept,
           [STRAGGLERS + "test_named_after_k_steps_in_a_row_and_cleared_by_one_step_that_is_"
            "not_slow"]),
]
