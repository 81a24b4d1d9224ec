"""The scheduler's whole state as plain values, and a scheduler rebuilt from them.

A new owner of a worker rebuilds from the state its last owner committed (state_journal.py) an identical
Scheduler (same queues in the same order, same block tables, reference counts, prefix-cache hashes and LRU
order, same computed token counts, same swapped tables), so the worker's KV cache stays valid.

What is stored and what is derived:

    stored                                   derived on restore
    ---------------------------------------  -----------------------------------------
    queues: groups in order, their seqs      request and seq id sets
    per seq: status, outputs, computed       device / CPU reference counts (how many
      tokens, device or CPU table, length      tables hold each block)
      of its prefix-hash chain               free lists (blocks no table holds and the
    cached blocks: hash, depth, LRU stamp      evictor does not hold)
    the cache's logical clock, hit counts    each chain's hashes (from the seq's tokens)

Reference counts are derived because every reference is a table entry: fork, prefix-cache hits and swaps
each add one per table. A snapshot is taken between steps, right after schedule() (a step planned, not yet
run), or with a step advanced and not landed (async scheduling: its samples are tokens in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.block_pool import CachedBlockEntry
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class SeqSnapshot:
    """One sequence: its tokens beyond the prompt, how far its KV is computed, where its KV lies."""

    seq_id: int
    status: SequenceStatus
    output_token_ids: tuple[int, ...]
    num_computed_tokens: int
    # Physical device block ids (the ring itself with a sliding window); None without a device table.
    block_table: tuple[int, ...] | None = None
    # CPU block ids of a swapped-out sequence; None otherwise.
    cpu_block_table: tuple[int, ...] | None = None
    # Leading blocks of its table already considered for the prefix cache; None: it registers none.
    num_hashed_blocks: int | None = None
    # Tokens sampled by a step in flight (Sequence.num_inflight_tokens).
    num_inflight_tokens: int = 0


@dataclass(frozen=True)
class GroupSnapshot:
    """One request: its prompt and parameters, its sequences in group order."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    arrival_time: float
    seqs: tuple[SeqSnapshot, ...]


@dataclass(frozen=True)
class SchedulerSnapshot:
    """A Scheduler between steps (or with one step planned and not run), as values."""

    waiting: tuple[GroupSnapshot, ...]
    running: tuple[GroupSnapshot, ...]
    swapped: tuple[GroupSnapshot, ...]
    # Blocks registered in the prefix cache, by block id (empty without prefix caching).
    cached_blocks: tuple[CachedBlockEntry, ...] = ()
    # The prefix cache's logical clock (orders the evictor) and its cumulative lookups, in blocks.
    clock: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def snapshot_scheduler(scheduler: Scheduler) -> SchedulerSnapshot:
    """The scheduler's state as values (see the module doc for what is left to derive)."""
    bm = scheduler.block_manager

    def seq_snapshot(seq: Sequence) -> SeqSnapshot:
        table = bm.block_tables.get(seq.seq_id)
        cpu_table = bm.swapper.cpu_tables.get(seq.seq_id)
        return SeqSnapshot(
            seq.seq_id, seq.status, tuple(seq.output_token_ids), seq.num_computed_tokens,
            None if table is None else tuple(table), None if cpu_table is None else tuple(cpu_table),
            bm.chain_length(seq.seq_id), seq.num_inflight_tokens,
        )

    def group_snapshot(group: SequenceGroup) -> GroupSnapshot:
        return GroupSnapshot(
            group.request_id, tuple(group.seqs[0].prompt_token_ids), group.sampling_params, group.arrival_time,
            tuple(seq_snapshot(seq) for seq in group.seqs),
        )

    queues = (tuple(map(group_snapshot, q)) for q in (scheduler.waiting, scheduler.running, scheduler.swapped))
    stats = bm.prefix_cache_stats
    return SchedulerSnapshot(*queues, cached_blocks=tuple(bm.block_pool.cached_blocks()), clock=bm.block_pool.clock,
                             prefix_cache_queries=stats.queries, prefix_cache_hits=stats.hits)


def restore_scheduler(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, snapshot: SchedulerSnapshot
) -> Scheduler:
    """A Scheduler in exactly the snapshot's state.

    Raises ValueError when the snapshot contradicts itself or the configuration (a block id out of
    range, a block in a table and in the evictor, a chain longer than its table, a seq id twice).
    """
    scheduler = Scheduler(scheduler_config, cache_config)
    queues: list[list[SequenceGroup]] = [[], [], []]
    tables: list[tuple[Sequence, list[int]]] = []
    cpu_tables: dict[int, list[int]] = {}
    chains: list[tuple[Sequence, int]] = []
    for queue, groups in zip(queues, (snapshot.waiting, snapshot.running, snapshot.swapped)):
        for g in groups:
            seqs = [
                Sequence(s.seq_id, list(g.prompt_token_ids), list(s.output_token_ids), s.num_computed_tokens, s.status,
                         s.num_inflight_tokens)
                for s in g.seqs
            ]
            queue.append(SequenceGroup(g.request_id, seqs, g.sampling_params, g.arrival_time))
            for seq, s in zip(seqs, g.seqs):
                if s.block_table is not None:
                    tables.append((seq, list(s.block_table)))
                if s.cpu_block_table is not None:
                    cpu_tables[s.seq_id] = list(s.cpu_block_table)
                if s.num_hashed_blocks is not None:
                    chains.append((seq, s.num_hashed_blocks))
    scheduler.restore_queues(*queues)
    bm = scheduler.block_manager
    bm.restore(tables, cpu_tables, snapshot.cached_blocks, snapshot.clock, chains)
    bm.prefix_cache_stats.queries = snapshot.prefix_cache_queries
    bm.prefix_cache_stats.hits = snapshot.prefix_cache_hits
    return scheduler


def load_snapshot(scheduler: Scheduler, snapshot: SchedulerSnapshot) -> None:
    """Puts a scheduler that holds nothing yet into exactly the snapshot's state (see restore_scheduler).

    On ValueError the scheduler is left as it was: the caller then recomputes instead of trusting it.
    """
    if scheduler.has_unfinished_requests() or scheduler.block_manager.block_tables:
        raise ValueError("a snapshot can only be loaded into a scheduler that holds nothing.")
    # Only a snapshot that loaded whole replaces the scheduler's parts.
    scheduler.__dict__.update(restore_scheduler(scheduler.scheduler_config, scheduler.cache_config, snapshot).__dict__)


def restore_step(
    scheduler: Scheduler, scheduled: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]] = (),
    blocks_to_swap_out: list[tuple[int, int]] = (), blocks_to_copy: list[tuple[int, int]] = (),
) -> SchedulerOutput:
    """The SchedulerOutput of a step planned before the snapshot and not run: (seq id, new tokens) in plan order.

    Its sequences' computed counts are still those it was planned from, so the output is the one
    schedule() returned (its groups and sequences are the restored scheduler's objects).
    """
    seqs = _seqs_by_id(scheduler)
    out = SchedulerOutput(blocks_to_swap_in=list(blocks_to_swap_in), blocks_to_swap_out=list(blocks_to_swap_out),
                          blocks_to_copy=list(blocks_to_copy))
    for seq_id, num_new_tokens in scheduled:
        if seq_id not in seqs:
            raise ValueError(f"the step schedules seq {seq_id}, which the restored scheduler does not hold.")
        out.scheduled.append(ScheduledSequence(*seqs[seq_id], num_new_tokens))
    out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
    return out


def restore_inflight_step(scheduler: Scheduler, scheduled: list[tuple[int, int, int]]) -> SchedulerOutput:
    """The SchedulerOutput of a step advanced before the snapshot and not landed (async scheduling):
    (seq id, new tokens, computed count when planned) in plan order.

    Its sequences' counts moved on since it was planned (Scheduler.advance), so each entry is rebuilt as
    planned: it samples exactly when the sequence holds a token in flight, which only this step can have added
    (the one before it landed first). Sequences the restored scheduler no longer holds, or holds finished, are
    left out: a finished sequence's token in flight is dropped when the step lands (Scheduler.resolve), and the
    snapshot keeps none for it, so it could not be rebuilt as planned.
    """
    seqs = _seqs_by_id(scheduler)
    out = SchedulerOutput()
    for seq_id, num_new_tokens, num_computed_tokens in scheduled:
        if seq_id in seqs and not seqs[seq_id][1].is_finished:
            group, seq = seqs[seq_id]
            num_tokens = num_computed_tokens + num_new_tokens if seq.num_inflight_tokens else seq.num_tokens
            out.scheduled.append(ScheduledSequence.as_planned(group, seq, num_new_tokens, num_computed_tokens,
                                                              num_tokens))
    out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
    return out


def _seqs_by_id(scheduler: Scheduler) -> dict[int, tuple[SequenceGroup, Sequence]]:
    return {s.seq_id: (g, s) for g in (*scheduler.running, *scheduler.swapped, *scheduler.waiting) for s in g.seqs}
