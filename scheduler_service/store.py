"""The Redis state store: requests, queues, step commits, output streams.

Admission writes a request record and pushes it to its worker's inbox. Each engine-loop step is
committed in one MULTI/EXEC transaction that also picks up the next admitted requests and aborts;
fenced by the loop's epoch (WATCH and GET before it), it costs three round trips, all overlapped with
the worker's step. Clients read their request's output stream; tokens appear there only once their
step is committed. Records: store_types.py; Lua scripts: store_scripts.py; a step's writes: step_writes.py.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from protos import generation_pb2, state_pb2
from scheduler_service import keys, stream_index
from scheduler_service import store_scripts as scripts
from scheduler_service.store_types import (
    AdmitOutcome,
    CacheStats,
    DuplicateRequestError,
    Pickup,
    QueueFullError,
    QueueLimits,
    RestoredRequest,
    StepCommit,
    StoredEngineState,
    StreamInfo,
    StreamState,
    WorkerGoneError,
    with_progress,
)
from scheduler_service.leases import LeaseLostError
from scheduler_service.step_writes import queue_step_writes
from shared import defaults, redis_client
from shared.errors import UnavailableError
from shared.worker_registry import heartbeat_key

# The records are part of the store's API: callers import them from here with RedisStore.
__all__ = [
    "INBOX_BATCH", "PREFIX_TTL_SECONDS", "AdmitOutcome", "CacheStats", "DuplicateRequestError",
    "Pickup", "QueueFullError", "QueueLimits", "RedisStore", "RestoredRequest", "StepCommit",
    "StoredEngineState", "StreamInfo", "StreamState", "WorkerGoneError",
]

# How long the router remembers which worker received a prompt block: about as long as an idle
# block survives in a busy prefix cache; a stale entry only costs one recomputed prefix.
PREFIX_TTL_SECONDS = 600
# Requests and aborts picked up per commit.
INBOX_BATCH = 64
# A replica's output-stream reader wake stream (stream_mux.py) is left to expire this long after its last use.
WAKE_TTL_SECONDS = 60

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _unavailable_on_redis_error(method: Callable[_P, Awaitable[_T]]) -> Callable[_P, Awaitable[_T]]:
    """Redis failures leave this module as UnavailableError (gRPC UNAVAILABLE), whatever the call."""

    @functools.wraps(method)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await method(*args, **kwargs)
        except (RedisError, OSError) as exc:
            raise UnavailableError(f"the state store is unavailable: {exc}") from exc

    return wrapper


def _indexed_messages(request_id: str, entries: list[tuple[bytes, dict[bytes, bytes]]]
                      ) -> list[generation_pb2.GenerateResponse]:
    """An output stream's entries as messages of `request_id`, each with its index (the entry id's sequence
    number). Neither is stored in the entries: the stream's key and the entry id say them."""
    out = []
    for entry_id, fields in entries:
        msg = generation_pb2.GenerateResponse.FromString(fields[b"m"])
        msg.request_id = request_id
        msg.index = stream_index.index_of(entry_id)
        out.append(msg)
    return out


class RedisStore:
    """Typed operations over the Redis state."""

    def __init__(self, client: aioredis.Redis, output_ttl_s: int = defaults.OUTPUT_RETENTION_S) -> None:
        """output_ttl_s: how long a finished request's output stream stays readable (--output-retention)."""
        self._r = client
        self.output_ttl_s = output_ttl_s

    @classmethod
    def from_url(cls, url: str) -> "RedisStore":
        return cls(redis_client.connect(url))

    @property
    def client(self) -> aioredis.Redis:
        return self._r

    async def close(self) -> None:
        await self._r.aclose()

    @_unavailable_on_redis_error
    async def ping(self) -> None:
        await self._r.ping()

    # -- admission ---------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def reserve_seq_ids(self, count: int) -> list[int]:
        """Globally unique sequence ids (shared by every scheduler replica)."""
        last = await self._r.incrby(keys.SEQ_ID_COUNTER, count)
        return list(range(last - count + 1, last + 1))

    @_unavailable_on_redis_error
    async def admit(self, req: state_pb2.AdmittedRequest, limits: QueueLimits | None = None,
                    digest: str = "", require_alive: bool = False) -> AdmitOutcome:
        """Records the request and queues it for its worker, atomically; or finds it already there.

        With a `digest` (the request's id was chosen by its client), a live or kept request with the
        same id and digest is not queued again: ATTACHED, the caller streams its output. A live
        duplicate id with another digest raises DuplicateRequestError; a worker queue at `limits`
        raises QueueFullError; with `require_alive`, a worker whose heartbeat expired raises
        WorkerGoneError (the servicer's admission: nothing may queue for a worker that left).
        """
        limits = limits or QueueLimits()
        w = req.worker_id
        status, requests, tokens = await self._r.eval(  # type: ignore[misc]
            scripts.ADMIT_LUA, 8,
            keys.request(req.request_id), keys.output_stream(req.request_id), keys.live(w), keys.inbox(w),
            keys.queued(w), keys.queue(w), keys.digest(req.request_id), heartbeat_key(w),
            req.SerializeToString(), w, req.request_id, len(req.prompt_token_ids),
            limits.max_requests, limits.max_tokens, digest, "1" if require_alive else "0",
        )
        if status == 4:
            return AdmitOutcome.ATTACHED
        if status == 5:
            raise WorkerGoneError(f"worker {w} left before request {req.request_id!r} could be queued for it")
        if status == 1:
            raise DuplicateRequestError(
                f"request id {req.request_id!r} is already in use by a live request that asked for something "
                "else; send exactly the same request to re-attach to it, or choose another id"
            )
        if status == 2:
            raise QueueFullError(
                f"the server is overloaded: {requests} requests are already queued for worker {w}, the limit is "
                f"{limits.max_requests} (--max-num-queued-requests); retry after a short backoff"
            )
        if status == 3:
            raise QueueFullError(
                f"the server is overloaded: {tokens} prompt tokens are already queued for worker {w} and this "
                f"request adds {len(req.prompt_token_ids)}, the limit is {limits.max_tokens} (--max-queued-tokens); "
                "retry after a short backoff"
            )
        return AdmitOutcome.ADMITTED

    @_unavailable_on_redis_error
    async def route_aborts(self, request_ids: list[str], skip_worker: str = "") -> int:
        """Queues aborts for the engine loops of the workers now serving these requests; returns how many.

        Requests that are gone (finished, never admitted) and those of `skip_worker` get none: a loop
        forwarding aborts of requests it no longer holds names itself there.
        """
        if not request_ids:
            return 0
        head, tail = keys.aborts("\0").split("\0")
        return int(await self._r.eval(  # type: ignore[misc]
            scripts.ROUTE_ABORTS_LUA, len(request_ids), *(keys.request(r) for r in request_ids),
            head, tail, skip_worker, *request_ids,
        ))

    # -- routing -----------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def routing_view(self, worker_ids: list[str], prefix_hashes: list[str]) -> tuple[dict[str, int], list[str | None]]:
        """Live requests per worker and the holder of each prompt block hash, in one round trip."""
        async with self._r.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.scard(keys.live(worker_id))
            if prefix_hashes:
                pipe.mget([keys.prefix_holder(h) for h in prefix_hashes])
            results = await pipe.execute()
        loads = {w: int(n) for w, n in zip(worker_ids, results)}
        holders = [v.decode() if v is not None else None for v in results[-1]] if prefix_hashes else []
        return loads, holders

    @_unavailable_on_redis_error
    async def remember_prefix(self, prefix_hashes: list[str], worker_id: str) -> None:
        """Records that `worker_id` now receives these prompt blocks (forgotten after PREFIX_TTL_SECONDS)."""
        async with self._r.pipeline(transaction=False) as pipe:
            for h in prefix_hashes:
                pipe.set(keys.prefix_holder(h), worker_id, ex=PREFIX_TTL_SECONDS)
            await pipe.execute()

    # -- engine loop -------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def wait_for_work(self, worker_id: str, timeout: float) -> Pickup:
        """Blocks until a request or abort arrives for the worker (or the timeout passes)."""
        item = await self._r.blpop([keys.inbox(worker_id), keys.aborts(worker_id)], timeout=timeout)
        if item is None:
            return Pickup([], [])
        key, value = item
        if key.decode() == keys.inbox(worker_id):
            return await self._pickup([value], [])
        return await self._pickup([], [value])

    async def _pickup(self, admitted: list[bytes], aborts: list[bytes]) -> Pickup:
        """What was taken off a worker's queues; handed-over requests are loaded with their outputs (rare)."""
        records = [state_pb2.AdmittedRequest.FromString(v) for v in admitted]
        moved = [r.request_id for r in records if r.handed_over]
        return Pickup(
            admitted=[r for r in records if not r.handed_over],
            aborts=[v.decode() for v in aborts],
            handed_over=await self._restore(moved),
        )

    @_unavailable_on_redis_error
    async def commit(self, c: StepCommit) -> Pickup:
        """Writes one step in one transaction and picks up new requests and aborts.

        A commit with an epoch is fenced: it applies only while the worker's epoch is still that one (WATCH,
        then MULTI/EXEC), else it raises LeaseLostError and writes nothing.
        """
        w = c.worker_id
        async with self._r.pipeline(transaction=True) as pipe:
            if c.epoch:
                await pipe.watch(keys.epoch(w))
                current = await pipe.get(keys.epoch(w))
                if current is None or int(current) != c.epoch:
                    raise LeaseLostError(f"worker {w} moved on to epoch {current!r}; this loop's epoch is {c.epoch}")
                pipe.multi()
            queue_step_writes(pipe, c, self.output_ttl_s)
            if c.pick_up:
                pipe.lpop(keys.inbox(w), INBOX_BATCH)
                pipe.lpop(keys.aborts(w), INBOX_BATCH)
            try:
                results = await pipe.execute()
            except WatchError as exc:
                raise LeaseLostError(f"worker {w} moved on past epoch {c.epoch} during the commit") from exc
        if not c.pick_up:
            return Pickup([], [])
        return await self._pickup(results[-2] or [], results[-1] or [])

    @_unavailable_on_redis_error
    async def load_picked_up(self, worker_id: str) -> list[RestoredRequest]:
        """Live requests of the worker that left its inbox (those still there are picked up as usual): what a
        new owner must continue, FCFS. Both are read in one transaction: a request queued in between would
        otherwise count as picked up."""
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.smembers(keys.live(worker_id))
            pipe.lrange(keys.inbox(worker_id), 0, -1)
            live, inbox = await pipe.execute()
        return await self._restore_picked_up(live, inbox)

    @_unavailable_on_redis_error
    async def load_engine_state(self, worker_id: str) -> StoredEngineState | None:
        """The worker's scheduler state as its last owner committed it; None when none was stored.

        Read in one transaction, so that it is one commit's state (commits are transactions too); the records
        and token lists of its requests follow (no commit can change them meanwhile: the caller holds the
        worker's new epoch, which fences every older loop).
        """
        w = worker_id
        async with self._r.pipeline(transaction=True) as pipe:
            for key in (keys.engine(w), keys.seq_states(w), keys.seq_progress(w), keys.cached_blocks(w), keys.stats(w)):
                pipe.hgetall(key)
            for key in (keys.waiting(w), keys.running(w), keys.swapped(w), keys.inbox(w)):
                pipe.lrange(key, 0, -1)
            pipe.smembers(keys.live(w))
            engine, seqs, progress, cached, stats, waiting, running, swapped, inbox, live = await pipe.execute()
        if not engine:
            return None
        queues = [[r.decode() for r in q] for q in (waiting, running, swapped)]
        restored = {r.record.request_id: r for r in await self._restore_picked_up(live, inbox)}
        in_queues = {r for q in queues for r in q}
        fields = {k.decode(): v for k, v in engine.items()}
        step, inflight = fields.get(keys.ENGINE_STEP), fields.get(keys.ENGINE_INFLIGHT)
        epoch, _, step_id = fields.get(keys.ENGINE_LAST_SENT, b"0:0").decode().partition(":")
        return StoredEngineState(
            valid=fields.get(keys.ENGINE_VALID) == b"1",
            clock=int(fields.get(keys.ENGINE_CLOCK, 0)),
            step=state_pb2.StepRecord.FromString(step) if step is not None else None,
            inflight=list(state_pb2.StepRecords.FromString(inflight).steps) if inflight is not None else [],
            last_sent=(int(epoch), int(step_id or 0)),
            instance_id=fields.get(keys.ENGINE_INSTANCE, b"").decode(),
            waiting=queues[0], running=queues[1], swapped=queues[2],
            requests={r: restored[r] for r in in_queues if r in restored},
            seq_states={int(k): with_progress(state_pb2.SequenceState.FromString(v), progress.get(k))
                        for k, v in seqs.items()},
            cached_blocks={int(k): state_pb2.CachedBlock.FromString(v) for k, v in cached.items()},
            prefix_cache_queries=int(stats.get(b"prefix_cache_queries", 0)),
            prefix_cache_hits=int(stats.get(b"prefix_cache_hits", 0)),
            picked_up=[r for r in restored.values() if r.record.request_id not in in_queues],
        )

    @_unavailable_on_redis_error
    async def invalidate_engine_state(self, worker_id: str) -> None:
        """Marks the worker's stored scheduler state as not to be continued (its next owner recomputes)."""
        await self._r.hset(keys.engine(worker_id), keys.ENGINE_VALID, b"0")

    async def _restore_picked_up(self, live: set[bytes], inbox: list[bytes]) -> list[RestoredRequest]:
        """The restored live requests (the worker's live set) that are no longer in its inbox."""
        queued = {state_pb2.AdmittedRequest.FromString(v).request_id for v in inbox}
        return await self._restore(sorted({m.decode() for m in live} - queued))

    async def _restore(self, ids: list[str]) -> list[RestoredRequest]:
        """The live ones of these requests with their committed outputs, oldest first (two round trips)."""
        if not ids:
            return []
        async with self._r.pipeline(transaction=False) as pipe:
            for request_id in ids:
                pipe.hgetall(keys.request(request_id))
            hashes = [h for h in await pipe.execute() if h.get(b"request")]
        records = [state_pb2.AdmittedRequest.FromString(h[b"request"]) for h in hashes]
        async with self._r.pipeline(transaction=False) as pipe:
            for record in records:
                for seq_id in record.seq_ids:
                    pipe.lrange(keys.seq_tokens(seq_id), 0, -1)
            token_lists = iter(await pipe.execute())
        restored = (
            RestoredRequest(
                record,
                {seq_id: [int(t) for t in next(token_lists)] for seq_id in record.seq_ids},
                {int(k[len(b"finished:"):]): v.decode() for k, v in h.items() if k.startswith(b"finished:")},
                {int(k[len(b"cum:"):]): float(v) for k, v in h.items() if k.startswith(b"cum:")},
            )
            for record, h in zip(records, hashes)
        )
        return sorted(restored, key=lambda r: r.record.arrival_time)

    # -- clients -----------------------------------------------------------------------------

    @_unavailable_on_redis_error
    async def read_from(
        self, request_id: str, from_index: int, block_ms: int | None
    ) -> list[generation_pb2.GenerateResponse]:
        """Committed messages of a request from index `from_index` on, each with its `index` set; waits up to
        `block_ms` for the first one when there is none yet (None: does not wait)."""
        cursor = {keys.output_stream(request_id): stream_index.read_cursor(from_index)}
        reply = await self._r.xread(cursor, block=block_ms)
        return [msg for _stream, entries in reply or [] for msg in _indexed_messages(request_id, entries)]

    @_unavailable_on_redis_error
    async def read_many(
        self, cursors: dict[str, int], wake_key: str, wake_id: str, block_ms: int
    ) -> tuple[dict[str, list[generation_pb2.GenerateResponse]], str]:
        """Committed messages of several requests, each from its index in `cursors`, in one XREAD.

        Waits up to `block_ms` for any of them, or for an entry after `wake_id` in `wake_key`
        (wake_reader). Returns the messages by request id and the wake stream's last entry id seen.
        """
        names = {keys.output_stream(request_id): request_id for request_id in cursors}
        streams = {wake_key: wake_id, **{name: stream_index.read_cursor(cursors[r]) for name, r in names.items()}}
        reply = await self._r.xread(streams, block=block_ms)
        out: dict[str, list[generation_pb2.GenerateResponse]] = {}
        for stream, entries in reply or []:
            if stream.decode() == wake_key:
                wake_id = entries[-1][0].decode()
            else:
                request_id = names[stream.decode()]
                out[request_id] = _indexed_messages(request_id, entries)
        return out, wake_id

    @_unavailable_on_redis_error
    async def wake_reader(self, wake_key: str) -> None:
        """Ends a read_many blocked on `wake_key` (its stream keeps one entry, and expires unused)."""
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.xadd(wake_key, {"w": b"1"}, maxlen=1, approximate=False)
            pipe.expire(wake_key, WAKE_TTL_SECONDS)
            await pipe.execute()

    @_unavailable_on_redis_error
    async def stream_info(self, request_id: str) -> StreamInfo:
        """Whether the request is live, finished with its stream kept, or gone; and its stream's length."""
        # One transaction: a request finishing in between could otherwise look gone (hash deleted, stream seen
        # before its final message).
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.exists(keys.request(request_id))
            pipe.xlen(keys.output_stream(request_id))
            live, length = await pipe.execute()
        if live:
            return StreamInfo(StreamState.LIVE, int(length))
        return StreamInfo(StreamState.FINISHED if length else StreamState.GONE, int(length))
