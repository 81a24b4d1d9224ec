"""A new owner's view of a worker: the state the last owner committed (state_journal.py) as a snapshot.

When a worker changes owner (a replica died, the lease moved), its new engine loop rebuilds its scheduler
from it and continues on the KV cache the worker kept (resume.py: the fence, the landing of steps the last
owner did not land, the worker's check of the new view against its cache).

Two kinds of request are recomputed rather than continued: beam searches (their beams are the
output processor's, rebuilt from the committed outputs) and prompts whose prompt logprobs were
still being gathered (the gathered part lived in the last owner's memory only).
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import state_pb2
from scheduler_service.core.block_pool import CachedBlockEntry
from scheduler_service.core.sequence import SequenceStatus
from scheduler_service.core.snapshot import GroupSnapshot, SchedulerSnapshot, SeqSnapshot
from scheduler_service.store import RestoredRequest, StoredEngineState
from shared.sampling_params import SamplingParams
from shared.sampling_proto import sampling_from_proto

_TABLE = state_pb2.SequenceState.Table


@dataclass
class Takeover:
    """What a new owner continues, and what it recomputes."""

    snapshot: SchedulerSnapshot
    # The requests of the snapshot (records and committed outputs), by request id.
    continued: dict[str, RestoredRequest]
    # Requests recomputed from prompt + committed outputs, in this order after the snapshot's waiting
    # queue: the beam searches and gathering prompt logprobs of the queues, then the requests picked up
    # and never queued.
    recomputed: list[RestoredRequest]


def takeover_from_store(state: StoredEngineState) -> Takeover:
    """The stored state as a snapshot. Raises ValueError when it is not valid or not complete."""
    if not state.valid:
        raise ValueError("the stored state is marked not to be continued (a resume from it failed)")
    continued: dict[str, RestoredRequest] = {}
    recomputed: list[RestoredRequest] = []
    queues: list[list[GroupSnapshot]] = [[], [], []]
    for queue, request_ids in zip(queues, (state.waiting, state.running, state.swapped)):
        for request_id in request_ids:
            request = state.requests.get(request_id)
            if request is None:
                raise ValueError(f"request {request_id!r} is queued but has no record")
            params = sampling_from_proto(request.record.sampling)
            gathering = params.prompt_logprobs is not None and not any(request.outputs.values())
            if params.use_beam_search or gathering:
                recomputed.append(request)
                continue
            queue.append(_group(request, state, params))
            continued[request_id] = request
    referenced = {b for q in queues for g in q for s in g.seqs for b in s.block_table or ()}
    cached = []
    for block_id, entry in sorted(state.cached_blocks.items()):
        stamp = None if entry.last_accessed < 0 else entry.last_accessed
        if stamp is None and block_id not in referenced:
            # Held by a recomputed request's table only: that table goes, the block becomes a plain free one.
            continue
        cached.append(CachedBlockEntry(block_id, entry.block_hash, entry.num_hashed_tokens, stamp))
    snapshot = SchedulerSnapshot(*map(tuple, queues), cached_blocks=tuple(cached), clock=state.clock,
                                 prefix_cache_queries=state.prefix_cache_queries,
                                 prefix_cache_hits=state.prefix_cache_hits)
    return Takeover(snapshot, continued, recomputed + state.picked_up)


def _group(request: RestoredRequest, state: StoredEngineState, params: SamplingParams) -> GroupSnapshot:
    record = request.record
    seqs = []
    for seq_id in record.seq_ids:
        stored = state.seq_states.get(seq_id)
        if stored is None:
            raise ValueError(f"seq {seq_id} of request {record.request_id!r} has no stored state")
        table = tuple(stored.block_table)
        if stored.status not in SequenceStatus.__members__:
            raise ValueError(f"seq {seq_id} has an unknown status {stored.status!r}")
        seqs.append(SeqSnapshot(
            seq_id=seq_id, status=SequenceStatus[stored.status],
            output_token_ids=tuple(request.outputs.get(seq_id, ())),
            num_computed_tokens=stored.num_computed_tokens,
            block_table=table if stored.table == _TABLE.DEVICE else None,
            cpu_block_table=table if stored.table == _TABLE.CPU else None,
            num_hashed_blocks=None if stored.num_hashed_blocks < 0 else stored.num_hashed_blocks,
            num_inflight_tokens=stored.num_inflight_tokens,
        ))
    return GroupSnapshot(record.request_id, tuple(record.prompt_token_ids), params, record.arrival_time, tuple(seqs))
