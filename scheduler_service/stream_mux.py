"""One blocking XREAD for all the output streams a replica's clients are reading, instead of one each.

Every Generate / Resume call waits for its request's next committed messages. With one XREAD per call,
a step commit of 64 requests wakes 64 Redis connections and 64 replies to parse on the replica's event
loop, the one that runs its engine loops: under load that was a fifth of a replica's CPU. Here one task
reads every followed stream from the index its readers wait for, and hands each reader its messages.

After handing a reader its messages the next XREAD goes on reading that stream from the following index,
where the reader will be back for more (a hint, dropped when the stream ends, when its messages find no
reader, or after HINT_SECONDS without one). A reader the XREAD in flight does not cover (a new request)
wakes it through a stream of the replica's own (`keys.reader_wake`), so its first token is not held back.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from protos import generation_pb2
from scheduler_service import keys
from scheduler_service.store import RedisStore

# How long the shared XREAD blocks; readers time out on their own (their block_ms).
BLOCK_MS = 5000
# How long a stream is read ahead for a reader that does not come back.
HINT_SECONDS = 2 * BLOCK_MS / 1000


@dataclass
class _Reader:
    from_index: int
    answer: asyncio.Future[list[generation_pb2.GenerateResponse]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


def _answer(answer: asyncio.Future[list[generation_pb2.GenerateResponse]],
            messages: list[generation_pb2.GenerateResponse]) -> None:
    if not answer.done():
        answer.set_result(messages)


class StreamMux:
    """Reads the output streams of many requests with one XREAD at a time (a `RedisStore.read_from` twin)."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._wake_key = keys.reader_wake(uuid.uuid4().hex)
        self._wake_id = "0-0"
        self._readers: dict[str, list[_Reader]] = {}
        # request id -> (index its reader comes back for, time.monotonic() after which that is not expected).
        self._hints: dict[str, tuple[int, float]] = {}
        # request id -> index the XREAD now in flight reads from (None: no XREAD in flight).
        self._reading: dict[str, int] | None = None
        self._task: asyncio.Task[None] | None = None

    async def read_from(self, request_id: str, from_index: int, block_ms: int) -> list[generation_pb2.GenerateResponse]:
        """Committed messages of a request from `from_index` on, waiting up to `block_ms` for the first."""
        reader = _Reader(from_index)
        self._readers.setdefault(request_id, []).append(reader)
        # The deadline is a timer that answers the reader with nothing: every message a client streams goes
        # through here, and asyncio.wait_for over a shielded future cost the event loop ~18 us a wait against ~8.
        # Whoever answers first wins (_answer); the mux skips a reader already answered, timed out or cancelled.
        deadline = asyncio.get_running_loop().call_later(block_ms / 1000, _answer, reader.answer, [])
        try:
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._run(), name="llmserve-stream-mux")
            elif self._reading is not None and self._reading.get(request_id, from_index + 1) > from_index:
                # The XREAD in flight does not read this stream from here: it must go round.
                await self._store.wake_reader(self._wake_key)
            return await reader.answer
        finally:
            deadline.cancel()
            readers = self._readers.get(request_id, [])
            if reader in readers:
                readers.remove(reader)
            if not readers:
                self._readers.pop(request_id, None)

    def _cursors(self) -> dict[str, int]:
        """Where the next XREAD reads each stream: its earliest reader's index, or its hint."""
        now = time.monotonic()
        self._hints = {r: hint for r, hint in self._hints.items() if hint[1] > now}
        cursors = {r: index for r, (index, _) in self._hints.items()}
        for request_id, readers in self._readers.items():
            cursors[request_id] = min(r.from_index for r in readers)
        return cursors

    async def _run(self) -> None:
        while cursors := self._cursors():
            self._reading = cursors
            try:
                batches, self._wake_id = await self._store.read_many(cursors, self._wake_key, self._wake_id, BLOCK_MS)
            except Exception as exc:  # noqa: BLE001 - every reader learns of it (UnavailableError: Redis away)
                for readers in self._readers.values():
                    for reader in readers:
                        if not reader.answer.done():
                            reader.answer.set_exception(exc)
                self._readers.clear()
                self._hints.clear()
                return
            finally:
                self._reading = None
            for request_id, messages in batches.items():
                self._deliver(request_id, cursors[request_id], messages)

    def _deliver(self, request_id: str, read_from: int, messages: list[generation_pb2.GenerateResponse]) -> None:
        """Answers the stream's readers whose index came; the rest wait for the next XREAD.

        A reader that joined below `read_from` (the index this XREAD read from) is not answered from it: it
        would miss the messages before; the next XREAD reads from its index.
        """
        waiting = []
        answered = False
        for reader in self._readers.get(request_id, []):
            mine = [m for m in messages if m.index >= reader.from_index] if reader.from_index >= read_from else []
            if mine and not reader.answer.done():
                reader.answer.set_result(mine)
                answered = True
            else:
                waiting.append(reader)
        # Answered readers leave at once; they come back from after the last message unless it was the final one.
        if waiting:
            self._readers[request_id] = waiting
        else:
            self._readers.pop(request_id, None)
        if answered and not messages[-1].HasField("usage"):
            self._hints[request_id] = (messages[-1].index + 1, time.monotonic() + HINT_SECONDS)
        else:
            self._hints.pop(request_id, None)
