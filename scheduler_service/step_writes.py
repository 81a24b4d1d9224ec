"""What one engine-loop step writes to Redis, queued on the fenced MULTI/EXEC pipeline of RedisStore.commit.

The order matters where writes touch the same keys: resets before the appends, dropped sequences after them.
"""

from __future__ import annotations

from redis.asyncio.client import Pipeline

from protos import state_pb2
from scheduler_service import keys
from scheduler_service import store_scripts as scripts
from scheduler_service.store_types import StepCommit
from shared.worker_registry import heartbeat_key


def _append_step_args(c: StepCommit) -> list[object] | None:
    """numkeys, KEYS and ARGV of APPEND_STEP_LUA for the commit's new tokens and outputs (None: none).

    An empty list is no write (as an RPUSH of nothing, which Redis refuses, would have aborted the commit).
    """
    lists = [(keys.seq_tokens(s), v) for s, v in c.new_tokens.items() if v]
    if not lists and not c.outputs:
        return None
    argv: list[object] = [len(lists)]
    for _, values in lists:
        argv.append(len(values))
        argv += values
    argv += [msg.SerializeToString() for _, msg in c.outputs]
    return [len(lists) + len(c.outputs), *(key for key, _ in lists), *(keys.output_stream(r) for r, _ in c.outputs),
            *argv]


def handed_over_record(record: state_pb2.AdmittedRequest, worker_id: str) -> bytes:
    """The request's record as the loop of `worker_id` picks it up: to recompute from its committed outputs."""
    moved = state_pb2.AdmittedRequest()
    moved.CopyFrom(record)
    moved.worker_id, moved.handed_over = worker_id, True
    return moved.SerializeToString()


def queue_step_writes(pipe: Pipeline, c: StepCommit, output_ttl_s: int) -> None:
    """Queues every write of the step `c` on `pipe` (already in MULTI); finished requests' outputs are kept for
    `output_ttl_s` seconds."""
    w = c.worker_id
    for request_id, seq_ids in c.reset_seqs.items():
        for seq_id in seq_ids:
            pipe.delete(keys.seq_tokens(seq_id))
            pipe.hdel(keys.request(request_id), f"finished:{seq_id}", f"cum:{seq_id}")
    # New tokens and output messages in one script call: one command per sequence costs redis-py ~10 us of
    # CPU each (packing, parsing its QUEUED reply). Placed after the resets and before the dropped sequences'
    # deletes; the output streams are no sequence's keys.
    appends = _append_step_args(c)
    if appends is not None:
        pipe.eval(scripts.APPEND_STEP_LUA, *appends)
    for seq_id in c.dropped_seqs:
        pipe.delete(keys.seq_tokens(seq_id))
    # The scheduler's state of the worker: sequence states and token counts, cached blocks, the engine hash (one
    # command each).
    if c.reset_engine_state:
        pipe.delete(keys.seq_states(w), keys.seq_progress(w), keys.cached_blocks(w), keys.engine(w))
    for key, written, dropped in (
        (keys.seq_states(w), c.seq_states, c.dropped_seq_states),
        (keys.seq_progress(w), c.seq_progress, c.dropped_seq_states),
        (keys.cached_blocks(w), c.cached_blocks, c.uncached_blocks),
        (keys.engine(w), c.engine_fields, c.dropped_engine_fields),
    ):
        if dropped:
            pipe.hdel(key, *dropped)
        if written:
            pipe.hset(key, mapping=written)
    for request_id, cumulative in c.cumulative_logprobs.items():
        pipe.hset(keys.request(request_id), mapping={f"cum:{s}": repr(v) for s, v in cumulative.items()})
    for request_id, seqs in c.finished_seqs.items():
        pipe.hset(keys.request(request_id), mapping={f"finished:{s}": status for s, status in seqs.items()})
    aborted = set(c.aborted_requests)
    for request_id in c.finished_requests:
        pipe.expire(keys.output_stream(request_id), output_ttl_s)  # Resume reads it while kept
        if request_id in aborted:
            pipe.delete(keys.digest(request_id))
        else:
            pipe.expire(keys.digest(request_id), output_ttl_s)  # re-sends attach while the stream is kept
        pipe.delete(keys.request(request_id))
        pipe.srem(keys.live(w), request_id)
    for record, target in c.handed_over:
        r = record.request_id
        pipe.eval(scripts.HAND_OVER_LUA, 6,
                  keys.request(r), keys.live(w), keys.inbox(w), keys.live(target), keys.inbox(target),
                  heartbeat_key(target),
                  handed_over_record(record, target), handed_over_record(record, w), target, r)
    # Scheduled (running / swapped), finished or handed-over requests no longer count as queued here (one that
    # comes back from a worker gone meanwhile is recomputed here, or handed over again, uncounted).
    dequeued = [*c.newly_scheduled, *c.finished_requests, *(r.request_id for r, _ in c.handed_over)]
    if dequeued:
        pipe.eval(scripts.DEQUEUE_LUA, 2, keys.queued(w), keys.queue(w), *dequeued)
    snapshots = ((keys.waiting(w), c.waiting), (keys.running(w), c.running), (keys.swapped(w), c.swapped))
    for key, snapshot in snapshots:
        if snapshot is not None:
            pipe.delete(key)
            if snapshot:
                pipe.rpush(key, *snapshot)
    if c.cache_stats is not None:
        pipe.hset(keys.stats(w), mapping=c.cache_stats.as_hash())
    for name, count in (("preemptions", c.num_preemptions), ("swaps", c.num_swaps),
                        ("worker_failures", c.num_worker_failures)):
        if count:
            pipe.hincrby(keys.stats(w), name, count)
