"""FCFS continuous-batching scheduler with a token budget and recompute preemption.

Optionally (vLLM semantics) with chunked prefill, where decodes, prompt chunks
and new prompts share each step's token budget, and with prefix caching,
where admitted prompts skip the tokens whose KV blocks are cached.

Parallel sampling (a group of n sequences with one prompt) computes the prompt
once by forking before the last prompt token:
- admission gives only the parent (the group's first unfinished sequence) a
  block table; the other sequences stay WAITING without one (pending fork);
- the parent prefills prompt_len - 1 tokens (chunks are capped there) and
  samples nothing;
- in the first schedule() that finds those tokens computed and schedules the
  group (at admission already when prompt_len is 1 or prefix-cache hits
  cover them), the scheduler forks: each other sequence gets a copy of the
  parent's table (every block shared, ref counted) and its
  num_computed_tokens, and becomes RUNNING. All n sequences are scheduled in that same step as 1-token decodes
  of the last prompt token, each sampling its own first token: the children
  append first and copy the shared last block on write (blocks_to_copy), the
  parent appends last and writes into it in place. A group whose n decodes
  do not fit a step (token budget) waits unforked, like any decode.
The worker sees nothing new: a child is a sequence it has never seen, sent
in full with num_computed_tokens = prompt_len - 1.

Preemption (vLLM v0 semantics), when a decode finds no free KV slot, takes
the latest-arrived running group:
- RECOMPUTE for a group with a single RUNNING sequence, or one whose RUNNING
  sequences are not all decoding (a pending-fork parent, a chunked re-prefill):
  its blocks are freed and it waits at the front of the waiting queue;
- SWAP, when a CPU swap space is configured (CacheConfig.num_cpu_blocks >
  0; with 0 every preemption is a recompute), for a group with several
  RUNNING sequences, all decoding (forked, n > 1): its blocks move to CPU blocks (blocks_to_swap_out), its sequences
  become SWAPPED and the group joins the swapped queue (FCFS). Both kinds are
  reported in SchedulerOutput.preempted. With no room in the CPU swap space
  the group fails instead: FINISHED_IGNORED, freed, in swap_failed.
A later step that preempts nothing swaps groups back in (FCFS, while they
fit with the watermark, the token budget and max_num_seqs) and schedules
them in that same step as 1-token decodes with num_computed_tokens kept.
A step never swaps both out and in, and nothing is admitted from the
waiting queue while any group is swapped out.
"""

from __future__ import annotations

from collections import deque

from scheduler_service.core.block_manager import AllocStatus, BlockManager
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus


class Scheduler:
    """Decides, step by step, which sequences run and which tokens they compute.

    Priority is the order of add_request (first come, first served); the
    running list and the waiting queue both stay in that order, so the last
    running group is always the latest arrival, the one preempted first.

    Engine loop contract: schedule() -> run the step -> update_after_step()
    -> check stops and finish_sequence(). Calling schedule() again without
    update_after_step() re-plans the same tokens (nothing is lost).

    max_num_seqs counts sequences, not groups: every unfinished sequence of a
    running group, pending-fork ones included; a group is admitted only when
    all its sequences fit. The token budget counts each sequence's tokens.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = BlockManager.from_config(cache_config, self._ring_blocks())
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self._requests: dict[str, SequenceGroup] = {}
        self._seq_ids: set[int] = set()

    def _ring_blocks(self) -> int | None:
        """Blocks a sliding-window sequence cycles through, or None to keep every block.

        One step computes at most max_num_batched_tokens tokens of a sequence
        and each of them reads the window before it, so a ring of window +
        max_num_batched_tokens - 1 slots never overwrites a key that the step
        still reads. Without chunked prefill the budget is usually as large as
        the context and the ring saves nothing; with it, a sequence holds at
        most that many slots however long it grows. Not with prefix caching:
        a reused block would no longer hold what its hash says.
        """
        window = self.cache_config.sliding_window
        if window is None or self.cache_config.enable_prefix_caching:
            return None
        block_size = self.cache_config.block_size
        # At least a block more than the window: the worker's table may keep stale ids for entries a
        # ring length back, which must stay outside the window.
        step_tokens = max(self.scheduler_config.max_num_batched_tokens, block_size)
        ring = -(-(window + step_tokens - 1) // block_size)
        return ring if ring < -(-self.scheduler_config.max_model_len // block_size) else None

    @property
    def max_seq_len(self) -> int:
        """Longest sequence that can always be (re)prefilled.

        A recomputed sequence must fit the cache and, without chunked prefill,
        the token budget of one step, so the engine should stop sequences at
        this length (pass it as max_model_len to check_stop); otherwise a
        preempted long sequence would come back as ignored. With chunked
        prefill the budget does not matter: prompts are split across steps.
        """
        usable_blocks = self.cache_config.num_gpu_blocks - self.cache_config.watermark_blocks
        ring = self.block_manager.ring_blocks
        if ring is not None and ring <= usable_blocks:
            # A sliding-window sequence needs its ring only, however long it grows.
            limit = self.scheduler_config.max_model_len
        else:
            limit = min(self.scheduler_config.max_model_len, usable_blocks * self.cache_config.block_size)
        if self.scheduler_config.enable_chunked_prefill:
            return limit
        return min(limit, self.scheduler_config.max_num_batched_tokens)

    # -- requests ------------------------------------------------------------

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a new request at the end of the waiting queue."""
        if group.request_id in self._requests:
            raise ValueError(f"request_id {group.request_id!r} is already scheduled.")
        for seq in group.seqs:
            if seq.status is not SequenceStatus.WAITING:
                raise ValueError(f"seq {seq.seq_id} of a new request must be WAITING, got {seq.status.name}.")
            if seq.seq_id in self._seq_ids:
                raise ValueError(f"seq_id {seq.seq_id} is already in use.")
        self._requests[group.request_id] = group
        self._seq_ids.update(seq.seq_id for seq in group.seqs)
        self.waiting.append(group)

    def abort_request(self, request_id: str) -> SequenceGroup | None:
        """Abort a request: free its blocks (CPU ones too) and drop it. None if unknown or done.

        Safe between schedule() and update_after_step(): aborted sequences of
        the in-flight step are skipped by the update.
        """
        group = self._requests.get(request_id)
        if group is None:
            return None
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
            self.block_manager.free(seq)
        self._remove(group)
        return group

    def finish_sequence(self, group: SequenceGroup, seq: Sequence, status: SequenceStatus) -> None:
        """Mark seq finished with status and free its blocks.

        Blocks shared with siblings (forked) stay theirs: only the reference
        is dropped. When the whole group is finished it leaves the scheduler.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}.")
        if self._requests.get(group.request_id) is not group or not any(s is seq for s in group.seqs):
            raise ValueError(f"seq {seq.seq_id} is not an active sequence of request {group.request_id!r}.")
        if seq.is_finished:
            raise ValueError(f"seq {seq.seq_id} is already finished ({seq.status.name}).")
        pending = group.pending_fork_seqs()
        if pending and seq.status is SequenceStatus.RUNNING:
            # The parent of a group that has not forked yet: its first pending
            # sibling takes over its table and its prefill.
            heir = pending[0]
            self.block_manager.fork(seq, heir)
            heir.status = SequenceStatus.RUNNING
        seq.status = status
        self.block_manager.free(seq)
        if group.is_finished():
            self._remove(group)

    # -- beam search ---------------------------------------------------------

    def replace_beams(self, group: SequenceGroup, drop: list[Sequence], add_finished: list[Sequence]) -> None:
        """Beam search bookkeeping after a step, before update_after_step.

        drop: the group's sequences that leave it (beams without a surviving
        child, hypotheses pushed out of the best ones): their blocks are freed
        and their seq_ids may be reused. add_finished: new finished hypotheses
        (they hold no blocks). A group left with nothing unfinished leaves
        the scheduler.
        """
        self._check_member(group)
        for seq in drop:
            if not any(s is seq for s in group.seqs):
                raise ValueError(f"seq {seq.seq_id} is not in request {group.request_id!r}.")
        for seq in add_finished:
            if not seq.is_finished:
                raise ValueError(f"seq {seq.seq_id} added as a hypothesis must be finished, got {seq.status.name}.")
        prompt = group.seqs[0].prompt_token_ids
        for seq in drop:
            if not seq.is_finished:
                # Marked finished so that update_after_step skips it if it was in the step.
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.block_manager.free(seq)
            group.seqs.remove(seq)
            self._seq_ids.discard(seq.seq_id)
        for seq in add_finished:
            self._add_to_group(group, seq, prompt)
        if group.is_finished():
            self._remove(group)

    def fork_seq(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """Add child to the group as a RUNNING copy of parent's blocks (beam search), after update_after_step.

        child holds parent's tokens up to its last one and a token of its
        own instead; the shared last block is copied on write when it grows.
        """
        self._check_member(group)
        if parent.status is not SequenceStatus.RUNNING or not any(s is parent for s in group.seqs):
            raise ValueError(f"seq {parent.seq_id} is not a running sequence of request {group.request_id!r}.")
        if child.seq_id in self._seq_ids:
            raise ValueError(f"seq_id {child.seq_id} is already in use.")
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self._add_to_group(group, child, parent.prompt_token_ids)

    def _check_member(self, group: SequenceGroup) -> None:
        if self._requests.get(group.request_id) is not group:
            raise ValueError(f"request {group.request_id!r} is not scheduled.")

    def _add_to_group(self, group: SequenceGroup, seq: Sequence, prompt: list[int]) -> None:
        if seq.seq_id in self._seq_ids:
            raise ValueError(f"seq_id {seq.seq_id} is already in use.")
        if seq.prompt_token_ids != prompt:
            raise ValueError(f"seq {seq.seq_id} must share the prompt of request {group.request_id!r}.")
        group.seqs.append(seq)
        self._seq_ids.add(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_requests(self) -> int:
        """Number of waiting, running and swapped-out requests."""
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def kv_occupancy(self) -> tuple[int, int]:
        """(slots in allocated device blocks, tokens those slots hold): internal fragmentation.

        A block shared by several tables counts once, as full as its fullest
        holder makes it. O(allocated blocks): for profiling, not every step.
        """
        bm = self.block_manager
        filled: dict[int, int] = {}
        for group in self.running:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                if not bm.has_block_table(seq):
                    continue
                for index, block_id in enumerate(bm.logical_block_table(seq)):
                    tokens = min(bm.block_size, max(0, seq.num_tokens - index * bm.block_size))
                    filled[block_id] = max(filled.get(block_id, 0), tokens)
        return bm.get_num_used_blocks() * bm.block_size, sum(filled.values())

    def get_block_table(self, seq: Sequence) -> list[int]:
        """Physical block ids of a scheduled sequence (for the step plan)."""
        return self.block_manager.get_block_table(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block (call after the worker lost its cache)."""
        self.block_manager.reset_prefix_cache()

    # -- stepping ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: decodes of running groups first, then new prefills.

        Never exceeds max_num_batched_tokens tokens or max_num_seqs running
        sequences. When a decode cannot get a KV slot the latest-arrived
        running group is preempted (recompute or swap, see the module doc);
        no group is swapped in or admitted in a step that preempted (the
        cache is under pressure). Otherwise swapped groups come back first,
        and prompts are admitted only when nothing is swapped out.

        With chunked prefill the budget goes, in this order, to the decodes
        (one token each), to the next chunk of running sequences still in
        prefill, then to the first chunk of newly admitted prompts; a chunk
        is min(uncomputed tokens, budget left) and samples only when it
        reaches the sequence's last token.
        """
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.scheduler_config.max_num_batched_tokens)
        if not out.preempted and not out.swap_failed:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def update_after_step(self, output: SchedulerOutput, sampled: dict[int, int]) -> None:
        """Record a finished step: advance computed tokens, append sampled ones.

        sampled maps seq_id -> token id for every scheduled sequence whose
        `samples` is True. Sequences finished meanwhile (aborted mid-step) are
        skipped. Validates everything before changing anything.
        """
        live = [s for s in output.scheduled if not s.seq.is_finished]
        expected = {s.seq.seq_id for s in output.scheduled if s.samples}
        missing = sorted(s.seq.seq_id for s in live if s.samples and s.seq.seq_id not in sampled)
        if missing:
            raise ValueError(f"sampled has no token for scheduled seq_ids {missing}.")
        unexpected = sorted(set(sampled) - expected)
        if unexpected:
            raise ValueError(f"sampled has tokens for seq_ids {unexpected} that were not scheduled to sample.")
        bad = {seq_id: tok for seq_id, tok in sampled.items() if not isinstance(tok, int) or tok < 0}
        if bad:
            raise ValueError(f"sampled token ids must be non-negative ints, got {bad}.")
        for s in live:
            if s.seq.num_computed_tokens != s.num_computed_tokens:
                raise ValueError(f"seq {s.seq.seq_id} changed since it was scheduled; stale output?")
        for s in live:
            s.seq.num_computed_tokens += s.num_new_tokens
            # Before append_token: the sampled token's KV is not written yet.
            self.block_manager.mark_computed(s.seq)
            if s.samples:
                s.seq.append_token(sampled[s.seq.seq_id])

    # -- internals -----------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule decodes in FCFS order, preempting from the back. Returns the budget left.

        A group whose parent has computed all but its last prompt token forks
        here, once its n decodes fit the step, and they are scheduled at once.
        With chunked prefill, sequences still in prefill are set aside and get
        their next chunk after every decode (see _schedule_prefill_chunks).
        """
        running = self.running
        chunked = self.scheduler_config.enable_chunked_prefill
        queue = deque(running)
        in_prefill: list[SequenceGroup] = []
        num_seqs = 0
        while queue:
            group = queue.popleft()
            items = self._tokens_to_compute(group)
            # Without chunking everything left is computed at once (a prefill
            # only shows up here when a step is re-planned).
            decodes = [(seq, n) for seq, n, is_decode in items if is_decode or not chunked]
            if decodes:
                num_new = sum(n for _, n in decodes)
                if num_seqs + len(decodes) > self.scheduler_config.max_num_seqs or num_new > budget:
                    # Out of room this step: the rest keep their blocks and wait a step.
                    break
                # A fork shares blocks only: its copies-on-write are the slots reserved next.
                self._fork_if_ready(group)
                if not self._reserve_slots(group, queue, out):
                    continue
                self._add_decodes(out, group, decodes)
                num_seqs += len(decodes)
                budget -= num_new
            if len(decodes) < len(items):
                # Its blocks were allocated at admission: it needs budget, no slot.
                in_prefill.append(group)
        if in_prefill:
            budget = self._schedule_prefill_chunks(out, in_prefill, budget, num_seqs)
        # Victims were the latest arrivals; everything else keeps its FCFS place.
        gone = out.preempted + out.swap_failed
        self.running = [g for g in running if not any(g is p for p in gone)]
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """Swap groups back in, FCFS, as 1-token decodes in this step. Returns the budget left."""
        num_running_seqs = sum(len(g.unfinished_seqs()) for g in self.running)
        while self.swapped:
            group = self.swapped[0]
            status = self.block_manager.can_swap_in(group)
            if status is AllocStatus.NEVER:
                self._ignore(group, out)
                continue
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if (
                status is AllocStatus.LATER
                or num_running_seqs + len(seqs) > self.scheduler_config.max_num_seqs
                or len(seqs) > budget
            ):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            # Each sequence computes its last token (swapped only when all were decoding).
            self._add_decodes(out, group, [(seq, 1) for seq in seqs])
            budget -= len(seqs)
            num_running_seqs += len(seqs)
            self.running.append(group)
        return budget

    def _reserve_slots(self, group: SequenceGroup, queue: deque[SequenceGroup], out: SchedulerOutput) -> bool:
        """Preempt from the back of queue until group's decodes get their slots; False if group itself went."""
        while not self.block_manager.can_append_slot(group):
            if not queue:
                self._preempt(group, out)
                return False
            self._preempt(queue.pop(), out)
        return True

    def _add_decodes(self, out: SchedulerOutput, group: SequenceGroup, items: list[tuple[Sequence, int]]) -> None:
        """Give each sequence its next slot (copy-on-write included) and schedule it.

        The children append before the parent (the first sequence), so right
        after a fork each child copies the shared last block and the parent,
        last, writes into it in place: the worker already has its table.
        """
        for seq, _ in items[1:] + items[:1]:
            cow = self.block_manager.append_slot(seq)
            if cow is not None:
                out.blocks_to_copy.append(cow)
        for seq, num_new in items:
            out.scheduled.append(ScheduledSequence(group, seq, num_new))

    def _schedule_prefill_chunks(
        self, out: SchedulerOutput, groups: list[SequenceGroup], budget: int, num_seqs: int
    ) -> int:
        """Give running sequences still in prefill their next chunk, FCFS. Returns the budget left."""
        for group in groups:
            prefills = [(seq, n) for seq, n, is_decode in self._tokens_to_compute(group) if not is_decode]
            chunk = self._chunk_size([n for _, n in prefills], budget)
            if chunk == 0 or num_seqs + len(prefills) > self.scheduler_config.max_num_seqs:
                break
            for seq, n in prefills:
                num_new = min(n, chunk)
                out.scheduled.append(ScheduledSequence(group, seq, num_new))
                budget -= num_new
            num_seqs += len(prefills)
        return budget

    @staticmethod
    def _chunk_size(num_uncomputed: list[int], budget: int) -> int:
        """Most tokens per sequence of a group's next chunk (one entry per sequence); 0 when the budget is out.

        The group's sequences prefill side by side: each computes min(its
        tokens, chunk), with the largest chunk that fits the budget, so the
        budget is split evenly between the sequences that still need it.
        """
        needs = sorted(num_uncomputed)
        for i, need in enumerate(needs):
            left = len(needs) - i
            if need * left > budget:
                return budget // left
            budget -= need  # sequence i gets all it needs, the others at least as much
        return needs[-1]

    def _tokens_to_compute(self, group: SequenceGroup) -> list[tuple[Sequence, int, bool]]:
        """(seq, tokens it may compute now, whether that is a 1-token decode) per sequence to run.

        That is every RUNNING sequence, except in a group that has not forked:
        its parent stops before the last prompt token (a capped prefill never
        samples, so it is never a decode, even for its last token), and once
        it got there, every unfinished sequence of the group, parent first,
        decodes that last token (the pending ones after _fork_if_ready).
        """
        pending = group.pending_fork_seqs()
        if pending:
            (parent,) = group.get_seqs(SequenceStatus.RUNNING)
            to_fork = len(parent.prompt_token_ids) - 1 - parent.num_computed_tokens
            if to_fork > 0:
                return [(parent, to_fork, False)]
            return [(seq, 1, True) for seq in [parent, *pending]]
        return [
            (seq, seq.num_uncomputed_tokens, seq.num_uncomputed_tokens == 1)
            for seq in group.get_seqs(SequenceStatus.RUNNING)
        ]

    def _fork_if_ready(self, group: SequenceGroup) -> bool:
        """Fork the pending sequences from a parent that computed all but its last prompt token.

        They get the parent's table (blocks shared) and num_computed_tokens
        and become RUNNING; True when that happened.
        """
        pending = group.pending_fork_seqs()
        if not pending:
            return False
        (parent,) = group.get_seqs(SequenceStatus.RUNNING)
        if parent.num_computed_tokens < len(parent.prompt_token_ids) - 1:
            return False
        for child in pending:
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting groups in FCFS order until one does not fit."""
        config = self.scheduler_config
        chunked = config.enable_chunked_prefill
        # Pending-fork sequences count: they run as soon as their group forks.
        num_running_seqs = sum(len(g.unfinished_seqs()) for g in self.running)
        while self.waiting:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            forks = group.forks_on_admission()
            # These can never run; drop them instead of letting them block the
            # queue forever.
            params = group.sampling_params
            # A beam search grows to best_of running beams after its prompt.
            too_wide = params.use_beam_search and (params.best_of or 1) > config.max_num_seqs
            if too_wide or self._can_never_run(seqs, forks):
                self._ignore(group, out)
                continue
            status = self.block_manager.can_allocate(group)
            if status is AllocStatus.NEVER:
                self._ignore(group, out)
                continue
            # FCFS: a group that must wait also holds back everything behind it.
            if status is AllocStatus.LATER:
                break
            if num_running_seqs + len(seqs) > config.max_num_seqs:
                break
            # Only the tokens to compute count against the budget, not the
            # ones allocate() will take from the prefix cache.
            num_new = self._admission_tokens(seqs, forks)
            if chunked:
                chunk = self._chunk_size(num_new, budget)
                if chunk == 0:
                    break
            else:
                if sum(num_new) > budget:
                    break
                chunk = max(num_new)
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for seq in seqs[:1] if forks else seqs:
                seq.status = SequenceStatus.RUNNING
            num_scheduled = len(out.scheduled)
            items = self._tokens_to_compute(group)
            if self._fork_if_ready(group):
                # Nothing to prefill before the last prompt token: n decodes right away.
                self._add_decodes(out, group, [(seq, n) for seq, n, _ in items])
            else:
                for seq, n, _ in items:
                    out.scheduled.append(ScheduledSequence(group, seq, min(n, chunk)))
            budget -= sum(s.num_new_tokens for s in out.scheduled[num_scheduled:])
            self.running.append(group)
            num_running_seqs += len(seqs)

    def _can_never_run(self, seqs: list[Sequence], forks: bool) -> bool:
        """True for waiting sequences that no step could ever admit.

        Without chunking, what admission computes must fit one step's budget
        whole: the parent's prefill and then the n forked decodes, or every
        sequence's full prefill (cache hits are not counted on: they may be
        evicted by the time a preempted sequence comes back). With chunking
        each sequence needs at least one token of a step.
        """
        config = self.scheduler_config
        if max(seq.num_tokens for seq in seqs) > config.max_model_len or len(seqs) > config.max_num_seqs:
            return True
        if config.enable_chunked_prefill:
            step_tokens = len(seqs)
        elif forks:
            step_tokens = max(len(seqs[0].prompt_token_ids) - 1, len(seqs))
        else:
            step_tokens = sum(seq.num_uncomputed_tokens for seq in seqs)
        return step_tokens > config.max_num_batched_tokens

    def _admission_tokens(self, seqs: list[Sequence], forks: bool) -> list[int]:
        """Tokens each sequence admitted now would compute (one entry per scheduled sequence).

        A forking group schedules its parent's prefill up to the last prompt
        token or, when nothing is left before it, its n decodes (1 each).
        """

        def num_computed(seq: Sequence) -> int:
            # allocate() sets num_computed_tokens to the cached prefix.
            if self.cache_config.enable_prefix_caching:
                return self.block_manager.get_num_cached_tokens(seq)
            return seq.num_computed_tokens

        if forks:
            parent = seqs[0]
            to_fork = len(parent.prompt_token_ids) - 1 - num_computed(parent)
            return [to_fork] if to_fork > 0 else [1] * len(seqs)
        return [seq.num_tokens - num_computed(seq) for seq in seqs]

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Preempt by swap (several sequences, all decoding) or else by recompute.

        Swap (only with a CPU pool): the RUNNING sequences' blocks move to CPU, they become SWAPPED
        and the group goes to the front of the swapped queue; without room in
        the CPU pool the group fails (FINISHED_IGNORED, out.swap_failed).

        Recompute: drop the KV, keep the tokens, wait at the front. Every
        RUNNING sequence of the group is freed and reset (pending-fork ones
        hold nothing). Once forked sequences have outputs they differ, so
        readmission prefills each one separately (see BlockManager.allocate).
        """
        running = group.get_seqs(SequenceStatus.RUNNING)
        swap = self.block_manager.num_cpu_blocks > 0 and len(running) > 1
        if swap and all(seq.num_uncomputed_tokens == 1 for seq in running):
            if not self.block_manager.can_swap_out(group):
                for seq in group.unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_IGNORED
                    self.block_manager.free(seq)
                self._remove(group)
                out.swap_failed.append(group)
                return
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in running:
                seq.status = SequenceStatus.SWAPPED
            # The caller (_schedule_running) rebuilds self.running without it.
            self.swapped.appendleft(group)
            out.preempted.append(group)
            return
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self.block_manager.free(seq)
            seq.reset_for_recompute()
        # The caller (_schedule_running) rebuilds self.running without it.
        self.waiting.appendleft(group)
        out.preempted.append(group)

    def _ignore(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_IGNORED
            self.block_manager.free(seq)
        self._remove(group)
        out.ignored.append(group)

    def _remove(self, group: SequenceGroup) -> None:
        """Forget a finished group, wherever it is queued."""
        if group in self.running:
            self.running.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
        elif group in self.swapped:
            self.swapped.remove(group)
        del self._requests[group.request_id]
        self._seq_ids.difference_update(seq.seq_id for seq in group.seqs)
