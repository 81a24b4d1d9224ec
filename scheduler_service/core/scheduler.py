"""FCFS continuous-batching scheduler with a token budget, preemption, chunked prefill and prefix caching.

vLLM v0 semantics. The parts, each in its own file: request_queues.py holds the queues and the request lifecycle,
token_budget.py the token arithmetic, group_fork.py how a parallel-sampling group computes its prompt once and
forks, preemption.py what a preempted group becomes (recompute or swap); Scheduler plans the steps (schedule)
and records their results (update_after_step, or advance then resolve under async scheduling).
"""

from __future__ import annotations

from collections import deque

from scheduler_service.core.block_manager import AdmissionPlan, AllocStatus
from scheduler_service.core.group_fork import add_decodes, fork_if_ready
from scheduler_service.core.preemption import Preemption, preempt_group
from scheduler_service.core.request_queues import RequestQueues
from scheduler_service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.core.token_budget import (
    can_never_run,
    chunk_size,
    max_seq_len,
    tokens_before_fork,
    tokens_to_compute,
)


class Scheduler(RequestQueues):
    """Decides, step by step, which sequences run and which tokens they compute.

    Priority is the order of add_request (first come, first served); the running list and the waiting queue
    both stay in that order, so the last running group is always the latest arrival, the one preempted first.

    Engine loop contract: schedule() -> run the step -> update_after_step() -> check stops and
    finish_sequence(). Calling schedule() again without update_after_step() re-plans the same tokens.

    max_num_seqs counts sequences, not groups: every unfinished sequence of a running group, pending-fork ones
    included; a group is admitted only when all its sequences fit. The token budget counts each one's tokens.
    """

    @property
    def max_seq_len(self) -> int:
        """Longest sequence that can always be (re)prefilled: the max_model_len for check_stop (token_budget)."""
        return max_seq_len(self.scheduler_config, self.cache_config, self.block_manager.ring_blocks)

    # -- stepping ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: decodes of running groups first, then new prefills.

        Never exceeds max_num_batched_tokens tokens or max_num_seqs running sequences. When a decode cannot get
        a KV slot the latest-arrived running group is preempted (preemption.py); no group is swapped in or
        admitted in a step that preempted (the cache is under pressure). Otherwise swapped groups come back
        first, and prompts are admitted only when nothing is swapped out.

        With chunked prefill the budget goes, in this order, to the decodes (one token each), to the next chunk
        of running sequences still in prefill, then to the first chunk of newly admitted prompts; a chunk samples
        only when it reaches the sequence's last token.
        """
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.scheduler_config.max_num_batched_tokens)
        if not out.preempted and not out.swap_failed:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        out.released_seq_ids = self.block_manager.take_released()
        for s in out.scheduled:
            s.table = self.block_manager.take_table_update(s.seq)
        return out

    def update_after_step(self, output: SchedulerOutput, sampled: dict[int, int]) -> None:
        """Record a finished step: advance computed tokens, append sampled ones (advance, then resolve).

        sampled maps seq_id -> token id for every scheduled sequence whose `samples` is True. Sequences finished
        meanwhile (aborted mid-step) are skipped. Validates everything before changing anything.
        """
        live = [s for s in output.scheduled if not s.seq.is_finished]
        sampling = [s for s in live if s.samples]
        self._check_sampled(output, sampled, sampling)
        self._check_unchanged(live)
        self._advance(live)
        self._resolve(sampling, sampled)

    def advance(self, output: SchedulerOutput) -> None:
        """The worker runs the step: its tokens count as computed and its samples as in flight.

        With async scheduling the engine calls this as soon as the step is sent and plans the next step before
        the result is back: each sampling sequence holds a token in flight (Sequence.num_inflight_tokens),
        decoded by the next step on the worker's own sample; resolve() fills in its value. Computed blocks are
        registered in the prefix cache now: a later step that reuses one runs on the worker after this one wrote it.
        """
        live = [s for s in output.scheduled if not s.seq.is_finished]
        self._check_unchanged(live)
        self._advance(live)

    def resolve(self, output: SchedulerOutput, sampled: dict[int, int]) -> None:
        """The step's result: each in-flight token of advance() becomes the sampled one.

        A sequence preempted since keeps its token (its recompute or swap-in starts from it); one
        finished since (stopped by its previous token, aborted) drops it.
        """
        waiting = [s for s in output.scheduled if s.samples and s.seq.num_inflight_tokens]
        self._check_sampled(output, sampled, [s for s in waiting if not s.seq.is_finished])
        self._resolve(waiting, sampled)
        for s in waiting:
            if not s.seq.is_finished:
                # A block computed while one of its tokens was in flight (mark_computed) can be registered now.
                self.block_manager.mark_computed(s.seq)

    def _advance(self, live: list[ScheduledSequence]) -> None:
        for s in live:
            s.seq.num_computed_tokens += s.num_new_tokens
            # Before the sampled token counts: its KV is not written by this step.
            self.block_manager.mark_computed(s.seq)
            if s.samples:
                s.seq.num_inflight_tokens += 1

    @staticmethod
    def _resolve(waiting: list[ScheduledSequence], sampled: dict[int, int]) -> None:
        for s in waiting:
            s.seq.resolve_inflight_token(None if s.seq.is_finished else sampled[s.seq.seq_id])

    @staticmethod
    def _check_sampled(output: SchedulerOutput, sampled: dict[int, int], expecting: list[ScheduledSequence]) -> None:
        expected = {s.seq.seq_id for s in output.scheduled if s.samples}
        missing = sorted(s.seq.seq_id for s in expecting if s.seq.seq_id not in sampled)
        if missing:
            raise ValueError(f"sampled has no token for scheduled seq_ids {missing}.")
        unexpected = sorted(set(sampled) - expected)
        if unexpected:
            raise ValueError(f"sampled has tokens for seq_ids {unexpected} that were not scheduled to sample.")
        bad = {seq_id: tok for seq_id, tok in sampled.items() if not isinstance(tok, int) or tok < 0}
        if bad:
            raise ValueError(f"sampled token ids must be non-negative ints, got {bad}.")

    @staticmethod
    def _check_unchanged(live: list[ScheduledSequence]) -> None:
        for s in live:
            if s.seq.num_computed_tokens != s.num_computed_tokens:
                raise ValueError(f"seq {s.seq.seq_id} changed since it was scheduled; stale output?")

    # -- internals -----------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule decodes in FCFS order, preempting from the back. Returns the budget left.

        A pending-fork group forks here once its n decodes fit the step (group_fork.py). With chunked prefill,
        sequences still in prefill are set aside and get their next chunk after every decode.
        """
        running = self.running
        chunked = self.scheduler_config.enable_chunked_prefill
        queue = deque(running)
        in_prefill: list[SequenceGroup] = []
        num_seqs = 0
        while queue:
            group = queue.popleft()
            items = [item for item in tokens_to_compute(group) if not self._ends_when_resolved(group, item[0])]
            # Without chunking everything left is computed at once (a prefill
            # only shows up here when a step is re-planned).
            decodes = [(seq, n) for seq, n, is_decode in items if is_decode or not chunked]
            if decodes:
                num_new = sum(n for _, n in decodes)
                if num_seqs + len(decodes) > self.scheduler_config.max_num_seqs or num_new > budget:
                    # Out of room this step: the rest keep their blocks and wait a step.
                    break
                # A fork shares blocks only: its copies-on-write are the slots reserved next.
                fork_if_ready(group, self.block_manager)
                if not self._reserve_slots(group, queue, out):
                    continue
                add_decodes(out, group, self.block_manager, decodes)
                num_seqs += len(decodes)
                budget -= num_new
            if len(decodes) < len(items):
                # Its blocks were allocated at admission: it needs budget, no slot.
                in_prefill.append(group)
        if in_prefill:
            budget = self._schedule_prefill_chunks(out, in_prefill, budget, num_seqs)
        # Victims were the latest arrivals; everything else keeps its FCFS place.
        gone = out.preempted + out.swap_failed
        if gone:
            self.running = [g for g in running if not any(g is p for p in gone)]
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """Swap groups back in, FCFS, as 1-token decodes in this step. Returns the budget left."""
        if not self.swapped:  # the running count below walks every running group
            return budget
        num_running_seqs = sum(len(g.unfinished_seqs()) for g in self.running)
        while self.swapped:
            group = self.swapped[0]
            status = self.block_manager.can_swap_in(group)
            if status is AllocStatus.NEVER:
                self._ignore(group, out)
                continue
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if status is AllocStatus.LATER or len(seqs) > budget:
                break
            if num_running_seqs + len(seqs) > self.scheduler_config.max_num_seqs:
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            # Each sequence computes its last token (swapped only when all were decoding).
            add_decodes(out, group, self.block_manager, [(seq, 1) for seq in seqs])
            budget -= len(seqs)
            num_running_seqs += len(seqs)
            self.running.append(group)
        return budget

    def _schedule_prefill_chunks(
        self, out: SchedulerOutput, groups: list[SequenceGroup], budget: int, num_seqs: int
    ) -> int:
        """Give running sequences still in prefill their next chunk, FCFS. Returns the budget left."""
        for group in groups:
            prefills = [(seq, n) for seq, n, is_decode in tokens_to_compute(group) if not is_decode]
            chunk = chunk_size([n for _, n in prefills], budget)
            if chunk == 0 or num_seqs + len(prefills) > self.scheduler_config.max_num_seqs:
                break
            for seq, n in prefills:
                num_new = min(n, chunk)
                out.scheduled.append(ScheduledSequence(group, seq, num_new))
                budget -= num_new
            num_seqs += len(prefills)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting groups in FCFS order until one does not fit."""
        if not self.waiting:  # the running count below walks every running group
            return
        config = self.scheduler_config
        # Pending-fork sequences count: they run as soon as their group forks.
        num_running_seqs = sum(len(g.unfinished_seqs()) for g in self.running)
        while self.waiting:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            forks = group.forks_on_admission()
            # A group that can never run is dropped instead of blocking the queue forever.
            params = group.sampling_params
            # A beam search grows to best_of running beams after its prompt.
            too_wide = params.use_beam_search and (params.best_of or 1) > config.max_num_seqs
            if too_wide or can_never_run(seqs, forks, config):
                self._ignore(group, out)
                continue
            plan = self.block_manager.plan_admission(group)
            if plan.status is AllocStatus.NEVER:
                self._ignore(group, out)
                continue
            # FCFS: a group that must wait also holds back everything behind it.
            if plan.status is AllocStatus.LATER:
                break
            if num_running_seqs + len(seqs) > config.max_num_seqs:
                break
            # Only the tokens to compute count against the budget, not those allocate() takes from the prefix cache.
            num_new = self._admission_tokens(seqs, forks, plan)
            if config.enable_chunked_prefill:
                chunk = chunk_size(num_new, budget)
            else:  # the whole prefill fits, or nothing
                chunk = max(num_new) if sum(num_new) <= budget else 0
            if chunk == 0:
                break
            self.waiting.popleft()
            self.block_manager.allocate(group, plan)
            for seq in seqs[:1] if forks else seqs:
                seq.status = SequenceStatus.RUNNING
            num_scheduled = len(out.scheduled)
            items = tokens_to_compute(group)
            if fork_if_ready(group, self.block_manager):
                # Nothing to prefill before the last prompt token: n decodes right away.
                add_decodes(out, group, self.block_manager, [(seq, n) for seq, n, _ in items])
            else:
                for seq, n, _ in items:
                    out.scheduled.append(ScheduledSequence(group, seq, min(n, chunk)))
            budget -= sum(s.num_new_tokens for s in out.scheduled[num_scheduled:])
            self.running.append(group)
            num_running_seqs += len(seqs)

    def _admission_tokens(self, seqs: list[Sequence], forks: bool, plan: AdmissionPlan) -> list[int]:
        """Tokens each sequence admitted now would compute (one entry per scheduled sequence): for a forking group
        its parent's prefill up to the last prompt token or, when nothing is left before it, its n decodes."""

        def num_computed(seq: Sequence) -> int:
            # allocate() sets num_computed_tokens to the cached prefix.
            if self.cache_config.enable_prefix_caching:
                return plan.num_cached_tokens(seq, self.cache_config.block_size)
            return seq.num_computed_tokens

        if forks:
            parent = seqs[0]
            to_fork = tokens_before_fork(parent, num_computed(parent))
            return [to_fork] if to_fork > 0 else [1] * len(seqs)
        return [seq.num_tokens - num_computed(seq) for seq in seqs]

    def _ends_when_resolved(self, group: SequenceGroup, seq: Sequence) -> bool:
        """Whether seq's token in flight will end it by length (max_tokens, the longest sequence), whatever
        it is: no step decodes it, the engine finishes it when the token comes back."""
        if not seq.num_inflight_tokens:
            return False
        max_tokens = group.sampling_params.max_tokens
        num_outputs = len(seq.output_token_ids) + seq.num_inflight_tokens
        return (max_tokens is not None and num_outputs >= max_tokens) or seq.num_tokens >= self.max_seq_len

    def _reserve_slots(self, group: SequenceGroup, queue: deque[SequenceGroup], out: SchedulerOutput) -> bool:
        """Preempt from the back of queue until group's decodes get their slots; False if group itself went."""
        while not self.block_manager.can_append_slot(group):
            if not queue:
                self._preempt(group, out)
                return False
            self._preempt(queue.pop(), out)
        return True

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Preempt group (see preemption.py) and requeue it at the front of its new queue.

        The caller (_schedule_running) rebuilds self.running without it.
        """
        preemption = preempt_group(group, self.block_manager, out)
        if preemption is Preemption.SWAP_FAILED:
            self._remove(group)
            out.swap_failed.append(group)
            return
        queue = self.swapped if preemption is Preemption.SWAP else self.waiting
        queue.appendleft(group)
        out.preempted.append(group)
