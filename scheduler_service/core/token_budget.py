"""Token and slot arithmetic of a scheduling step: pure functions of configs and sequences.

Nothing here changes a sequence or a queue; the Scheduler decides with these numbers.
"""

from __future__ import annotations

from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus


def sliding_window_ring_blocks(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> int | None:
    """Blocks a sliding-window sequence cycles through (BlockManager's ring), or None to keep every block.

    One step computes at most max_num_batched_tokens tokens of a sequence and each of them reads the window
    before it, so a ring of window + max_num_batched_tokens - 1 slots never overwrites a key that the step
    still reads. Without chunked prefill the budget is usually as large as the context and the ring saves
    nothing; with it, a sequence holds at most that many slots however long it grows. Never with prefix caching
    (see BlockManager).
    """
    window = cache_config.sliding_window
    if window is None or cache_config.enable_prefix_caching:
        return None
    block_size = cache_config.block_size
    # At least a block more than the window: the worker's table may keep stale ids for entries a
    # ring length back, which must stay outside the window.
    step_tokens = max(scheduler_config.max_num_batched_tokens, block_size)
    ring = -(-(window + step_tokens - 1) // block_size)
    return ring if ring < -(-scheduler_config.max_model_len // block_size) else None


def max_seq_len(scheduler_config: SchedulerConfig, cache_config: CacheConfig, ring_blocks: int | None) -> int:
    """Longest sequence that can always be (re)prefilled; ring_blocks as the BlockManager uses it.

    A recomputed sequence must fit the cache and, without chunked prefill, the token budget of one step, so
    the engine should stop sequences at this length (pass it as max_model_len to check_stop); otherwise a
    preempted long sequence would come back as ignored. With chunked prefill prompts are split across steps.
    """
    usable_blocks = cache_config.num_gpu_blocks - cache_config.watermark_blocks
    if ring_blocks is not None and ring_blocks <= usable_blocks:
        # A sliding-window sequence needs its ring only, however long it grows.
        limit = scheduler_config.max_model_len
    else:
        limit = min(scheduler_config.max_model_len, usable_blocks * cache_config.block_size)
    if scheduler_config.enable_chunked_prefill:
        return limit
    return min(limit, scheduler_config.max_num_batched_tokens)


def chunk_size(num_uncomputed: list[int], budget: int) -> int:
    """Most tokens per sequence of a group's next chunk (one entry per sequence); 0 when the budget is out.

    The group's sequences prefill side by side: each computes min(its tokens, chunk), with the largest chunk
    that fits the budget, so the budget is split evenly between the sequences that still need it.
    """
    needs = sorted(num_uncomputed)
    for i, need in enumerate(needs):
        left = len(needs) - i
        if need * left > budget:
            return budget // left
        budget -= need  # sequence i gets all it needs, the others at least as much
    return needs[-1]


def tokens_before_fork(parent: Sequence, num_computed: int) -> int:
    """Prompt tokens a pending-fork group's parent still prefills, computed up to num_computed.

    The parent stops before the last prompt token; the group forks once this is 0 (or less: a prefix
    cache hit may cover more).
    """
    return len(parent.prompt_token_ids) - 1 - num_computed


def tokens_to_compute(group: SequenceGroup) -> list[tuple[Sequence, int, bool]]:
    """(seq, tokens it may compute now, whether that is a 1-token decode) per sequence to run.

    That is every RUNNING sequence, except in a group that has not forked (group_fork.py): its parent stops
    before the last prompt token (a capped prefill never samples, so it is never a decode, even for its last
    token), then every unfinished sequence of the group, parent first, decodes that last token.
    """
    if len(group.seqs) == 1:  # most requests (n = 1): never a pending fork
        (seq,) = group.seqs
        if seq.status is not SequenceStatus.RUNNING:
            return []
        n = seq.num_uncomputed_tokens
        return [(seq, n, n == 1)]
    pending = group.pending_fork_seqs()
    if pending:
        (parent,) = group.get_seqs(SequenceStatus.RUNNING)
        to_fork = tokens_before_fork(parent, parent.num_computed_tokens)
        if to_fork > 0:
            return [(parent, to_fork, False)]
        return [(seq, 1, True) for seq in [parent, *pending]]
    running = group.get_seqs(SequenceStatus.RUNNING)
    return [(seq, seq.num_uncomputed_tokens, seq.num_uncomputed_tokens == 1) for seq in running]


def can_never_run(seqs: list[Sequence], forks: bool, config: SchedulerConfig) -> bool:
    """True for waiting sequences that no step could ever admit.

    Without chunking, what admission computes must fit one step's budget whole: the parent's prefill (the whole
    prompt, see below) and then the n forked decodes, or every sequence's full prefill (cache hits are not
    counted on: they may be evicted by the time a preempted sequence comes back). With chunking each sequence
    needs at least one token of a step.
    """
    if max(seq.num_tokens for seq in seqs) > config.max_model_len or len(seqs) > config.max_num_seqs:
        return True
    if config.enable_chunked_prefill:
        step_tokens = len(seqs)
    elif forks:
        # The whole prompt, not the parent's prompt_len - 1: a parent that finishes before the fork
        # hands its table to a sibling, which then computes the whole prompt in one step.
        step_tokens = max(len(seqs[0].prompt_token_ids), len(seqs))
    else:
        step_tokens = sum(seq.num_uncomputed_tokens for seq in seqs)
    return step_tokens > config.max_num_batched_tokens
