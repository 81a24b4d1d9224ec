"""Reading a request's committed output stream from any index, on any replica.

Generate (the admitting call and idempotent re-sends) and Resume both stream through `follow`; only Redis
is needed, so a client can re-attach to any scheduler replica. Messages carry their index (stream_index),
so a resumed stream continues with no message lost or repeated.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from protos import generation_pb2
from scheduler_service.store import RedisStore, StreamState
from shared.errors import InvalidRequestError, NotFoundError, OutOfRangeError


async def check_resumable(store: RedisStore, request_id: str, from_index: int) -> None:
    """Raises unless `request_id`'s stream exists and can still yield the message at `from_index`.

    NOT_FOUND for an unknown or expired id, OUT_OF_RANGE when the request finished before that index;
    a live request's future index is fine (the reader waits for it).
    """
    if not request_id:
        raise InvalidRequestError("request_id is required to resume a stream")
    await _check_stream(store, request_id, from_index, (
        f"no request has id {request_id!r}: it was never admitted, or it finished more than "
        f"{store.output_ttl_s} s ago and its output stream expired (or Redis lost its data)"
    ))


Reader = Callable[[str, int, int], Awaitable[list[generation_pb2.GenerateResponse]]]


async def follow(
    store: RedisStore, request_id: str, from_index: int, block_ms: int, read_from: Reader | None = None,
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The request's messages from `from_index` up to its final one (the one with usage), in order.

    Waits for messages not committed yet. Every `block_ms` without a message it checks that the request
    still exists, so a reader never waits forever on a stream that expired or ended before its index.
    `read_from`: how the messages are read (a replica's StreamMux; the store's own XREAD by default).
    """
    read = read_from if read_from is not None else store.read_from
    next_index = from_index
    while True:
        batch = await read(request_id, next_index, block_ms)
        if not batch:
            await _check_stream(store, request_id, next_index,
                                f"the output stream of request {request_id!r} expired while it was being read "
                                f"(or Redis lost its data)")
            continue  # live, or its final message was committed just after the read
        for msg in batch:
            yield msg
            if msg.HasField("usage"):
                return
        next_index = batch[-1].index + 1


async def _check_stream(store: RedisStore, request_id: str, index: int, gone: str) -> None:
    """Raises NotFoundError(`gone`) when the request's stream is gone, OutOfRangeError when the request
    finished before `index`."""
    info = await store.stream_info(request_id)
    if info.state is StreamState.GONE:
        raise NotFoundError(gone)
    if info.state is StreamState.FINISHED and index >= info.length:
        raise OutOfRangeError(f"request {request_id!r} finished with {info.length} messages "
                              f"(indexes 0 to {info.length - 1}); index {index} is past its end")
