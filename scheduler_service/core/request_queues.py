"""The requests a Scheduler holds and the verbs that move them in and out.

RequestQueues owns the scheduler's state (the FCFS queues, the ids in use, the BlockManager holding their KV
blocks) and the request lifecycle the engine loop drives between steps: add, abort, finish, beam-search forks
and drops. Planning a step is the Scheduler's, which builds on this class.
"""

from __future__ import annotations

from collections import deque

from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.core.token_budget import sliding_window_ring_blocks


class RequestQueues:
    """Requests by queue (waiting, running, swapped), their seq ids and KV blocks.

    Every request is in exactly one queue until it finishes, is aborted or is ignored; then it leaves the
    queues and its ids may be reused.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = BlockManager.from_config(
            cache_config, sliding_window_ring_blocks(scheduler_config, cache_config)
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self._requests: dict[str, SequenceGroup] = {}
        self._seq_ids: set[int] = set()

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

        Safe between schedule() and update_after_step(): aborted sequences of the in-flight step are skipped.
        """
        group = self._requests.get(request_id)
        if group is None:
            return None
        self.block_manager.finish_group(group, SequenceStatus.FINISHED_ABORTED)
        self._remove(group)
        return group

    def finish_sequence(self, group: SequenceGroup, seq: Sequence, status: SequenceStatus) -> None:
        """Mark seq finished with status and free its blocks (those shared with forked siblings stay theirs).

        When the whole group is finished it leaves the scheduler.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}.")
        if self._requests.get(group.request_id) is not group or not any(s is seq for s in group.seqs):
            raise ValueError(f"seq {seq.seq_id} is not an active sequence of request {group.request_id!r}.")
        if seq.is_finished:
            raise ValueError(f"seq {seq.seq_id} is already finished ({seq.status.name}).")
        pending = group.pending_fork_seqs()
        if pending and seq.status is SequenceStatus.RUNNING:
            # The parent of a group that has not forked yet: its first pending sibling takes over its table and prefill.
            heir = pending[0]
            self.block_manager.fork(seq, heir)
            heir.status = SequenceStatus.RUNNING
        seq.status = status
        self.block_manager.free(seq)
        if group.is_finished():
            self._remove(group)

    def group(self, request_id: str) -> SequenceGroup | None:
        """The request's group while it is waiting, running or swapped; None otherwise."""
        return self._requests.get(request_id)

    def restore_queues(
        self, waiting: list[SequenceGroup], running: list[SequenceGroup], swapped: list[SequenceGroup]
    ) -> None:
        """Hold these groups, in these queues and orders (a new scheduler restored from a snapshot).

        Their block tables are the block manager's to restore; here only the ids are checked.
        """
        for group in [*waiting, *running, *swapped]:
            if group.request_id in self._requests:
                raise ValueError(f"request_id {group.request_id!r} appears twice.")
            for seq in group.seqs:
                if seq.seq_id in self._seq_ids:
                    raise ValueError(f"seq_id {seq.seq_id} appears twice.")
                self._seq_ids.add(seq.seq_id)
            self._requests[group.request_id] = group
        self.waiting, self.running, self.swapped = deque(waiting), list(running), deque(swapped)

    # -- beam search ---------------------------------------------------------

    def replace_beams(self, group: SequenceGroup, drop: list[Sequence], add_finished: list[Sequence]) -> None:
        """Beam search bookkeeping after a step, before update_after_step.

        drop: the group's sequences that leave it (beams without a surviving child, hypotheses pushed out of the
        best ones): their blocks are freed and their seq_ids may be reused. add_finished: new finished
        hypotheses (they hold no blocks). A group left with nothing unfinished leaves the scheduler.
        """
        self._check_member(group)
        for seq in drop:
            if not any(s is seq for s in group.seqs):
                raise ValueError(f"seq {seq.seq_id} is not in request {group.request_id!r}.")
        for seq in add_finished:
            if not seq.is_finished:
                raise ValueError(f"seq {seq.seq_id} added as a hypothesis must be finished, got {seq.status.name}.")
        prompt = group.seqs[0].prompt_token_ids
        # Every check before the first block is freed: a bad hypothesis leaves the group as it was.
        self._check_joining(group, add_finished, prompt, freed={seq.seq_id for seq in drop})
        for seq in drop:
            if not seq.is_finished:
                # Marked finished so that update_after_step skips it if it was in the step.
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.block_manager.free(seq)
            group.seqs.remove(seq)
            self._seq_ids.discard(seq.seq_id)
        for seq in add_finished:
            self._add_to_group(group, seq)
        if group.is_finished():
            self._remove(group)

    def fork_seq(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """Add child to the group as a RUNNING copy of parent's blocks (beam search), after update_after_step.

        child holds parent's tokens up to its last one and a token of its own instead (copied on write).
        """
        self._check_member(group)
        if parent.status is not SequenceStatus.RUNNING or not any(s is parent for s in group.seqs):
            raise ValueError(f"seq {parent.seq_id} is not a running sequence of request {group.request_id!r}.")
        # Checked before the fork: a child that cannot join must not be left holding references to parent's blocks.
        self._check_joining(group, [child], parent.prompt_token_ids)
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self._add_to_group(group, child)

    def _check_member(self, group: SequenceGroup) -> None:
        if self._requests.get(group.request_id) is not group:
            raise ValueError(f"request {group.request_id!r} is not scheduled.")

    def _check_joining(self, group: SequenceGroup, seqs: list[Sequence], prompt: list[int],
                       freed: frozenset[int] | set[int] = frozenset()) -> None:
        """Raises unless every seq may join the group: a free seq_id (`freed`: ids that leave it first) and its prompt."""
        taken = self._seq_ids - freed
        for seq in seqs:
            if seq.seq_id in taken:
                raise ValueError(f"seq_id {seq.seq_id} is already in use.")
            taken.add(seq.seq_id)
            if seq.prompt_token_ids != prompt:
                raise ValueError(f"seq {seq.seq_id} must share the prompt of request {group.request_id!r}.")

    def _add_to_group(self, group: SequenceGroup, seq: Sequence) -> None:
        """Adds a seq that _check_joining accepted."""
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

        A block shared by several tables counts once, as full as its fullest holder makes it. O(allocated
        blocks): for profiling, not every step.
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

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block (call after the worker lost its cache)."""
        self.block_manager.reset_prefix_cache()

    # -- leaving the queues --------------------------------------------------

    def _ignore(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Drop a group that can never run: its sequences end FINISHED_IGNORED, reported in out.ignored."""
        self.block_manager.finish_group(group, SequenceStatus.FINISHED_IGNORED)
        self._remove(group)
        out.ignored.append(group)

    def _remove(self, group: SequenceGroup) -> None:
        """Forget a finished group, wherever it is queued."""
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
                break
        del self._requests[group.request_id]
        self._seq_ids.difference_update(seq.seq_id for seq in group.seqs)
