"""A Generate stream that survives a dropped connection or a lost scheduler replica.

Every GenerateResponse carries its `index` in the request's stream. The stream remembers the next
index it needs; when a call breaks with UNAVAILABLE (connection dropped, replica gone) it waits a
backoff and re-attaches, to the next address of its list, within the call's deadline:

    nothing received yet  ->  Generate(same request) again: idempotent by request id, it admits the
                              request if the first call never did, else re-attaches from index 0
    messages 0..k-1 seen  ->  Resume(request_id, from_index=k): exactly the messages from k on

so its caller sees one uninterrupted stream, with no message lost or repeated.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from protos import generation_pb2, generation_pb2_grpc
from shared.grpc_server import CLIENT_KEEPALIVE_MS, CLIENT_PING_TIMEOUT_MS, keepalive_options

log = logging.getLogger(__name__)


# A lost replica's channel retries its connection with a backoff that gRPC grows up to 120 s by default;
# a resuming stream wants to notice within a second that the replica (or its replacement) is back, and within
# seconds that a replica went silent (keepalive, shared/grpc_server.py: a false alarm only re-attaches).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
                     *keepalive_options(CLIENT_KEEPALIVE_MS, CLIENT_PING_TIMEOUT_MS)]


@dataclass(frozen=True)
class ResumePolicy:
    """How a stream re-attaches after UNAVAILABLE."""

    # First wait before re-attaching; doubled after each failed attempt up to max_backoff_s.
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    # Without a deadline on the call, give up after this long without a message since the stream broke.
    max_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.initial_backoff_s <= 0:
            raise ValueError(f"initial_backoff_s must be positive, got {self.initial_backoff_s}")
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(f"max_backoff_s must be at least initial_backoff_s ({self.initial_backoff_s}), "
                             f"got {self.max_backoff_s}")
        if self.max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be positive, got {self.max_wait_s}")

    def backoff_s(self, failures: int) -> float:
        """The wait before the next re-attachment after `failures` failed ones since the break."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** failures)


class ResumingStream(Iterator[generation_pb2.GenerateResponse]):
    """Iterates one request's GenerateResponses across re-attachments; `cancel()` ends it."""

    def __init__(self, stubs: list[generation_pb2_grpc.GenerationStub], request: generation_pb2.GenerateRequest,
                 timeout: float | None, policy: ResumePolicy,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        if not stubs:
            raise ValueError("at least one scheduler address is needed")
        if not request.request_id:
            # Re-sending must name the same request, or a lost first call could generate twice.
            own = generation_pb2.GenerateRequest()
            own.CopyFrom(request)
            own.request_id = uuid.uuid4().hex
            request = own
        self._stubs = stubs
        self._request = request
        self._policy = policy
        self._sleep, self._clock = sleep, clock
        self._deadline = None if timeout is None else clock() + timeout
        self._address = 0
        self._next_index = 0
        self._failures = 0
        self._broken_since: float | None = None
        self._finished = False
        self._cancelled = False
        # The first call waits for the server to come up, as a plain Generate call does.
        self._call = self._stubs[0].Generate(request, timeout=timeout, wait_for_ready=True)
        self._first_call = True

    @property
    def request_id(self) -> str:
        """The request's id (chosen here when the request had none)."""
        return self._request.request_id

    @property
    def next_index(self) -> int:
        """Index of the next message this stream will yield (= messages received so far)."""
        return self._next_index

    def __iter__(self) -> "ResumingStream":
        return self

    def __next__(self) -> generation_pb2.GenerateResponse:
        while True:
            try:
                msg = next(self._call)
            except grpc.RpcError as exc:
                if self._finished:
                    # The final message (the one with usage) came: the response is whole, whatever ended the call
                    # after it (a scheduler that died before sending the call's status).
                    raise StopIteration from None
                if self._cancelled or exc.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                        self._abandon()
                    raise
                self._reattach(exc)
                continue
            self._failures, self._broken_since = 0, None
            if msg.index < self._next_index:
                continue  # already yielded before a re-attachment (never expected: Resume starts at next_index)
            self._next_index = msg.index + 1
            self._finished = msg.HasField("usage")
            return msg

    def cancel(self) -> None:
        """Ends the stream. A non-resumable request is aborted (by the server when this is still the
        call that admitted it, else by an Abort call); a resumable one keeps running."""
        self._cancelled = True
        self._call.cancel()
        self._abandon()

    def _abandon(self) -> None:
        # The server aborts a non-resumable request only when the call that admitted it ends; after a
        # re-attachment that call is gone, so the client says it.
        if self._first_call or self._finished or self._request.resumable:
            return
        try:
            self._stubs[self._address].Abort(generation_pb2.AbortRequest(request_id=self.request_id), timeout=5)
        except grpc.RpcError:
            pass  # best effort: the request may have finished, or the server may be unreachable

    def _reattach(self, cause: grpc.RpcError) -> None:
        """Waits a backoff, then opens the call that continues at next_index on the next address."""
        now = self._clock()
        if self._broken_since is None:
            self._broken_since = now
        give_up_at = self._deadline if self._deadline is not None else self._broken_since + self._policy.max_wait_s
        delay = self._policy.backoff_s(self._failures)
        if now + delay >= give_up_at:
            raise cause
        if self._failures == 0:
            # Once a break: a caller waiting on a server with no worker (or none at all) learns why it waits.
            log.warning("request %s: %s (%s); retrying for up to %.0f s", self.request_id,
                        cause.code().name, cause.details(), give_up_at - now)  # type: ignore[attr-defined]
        self._sleep(delay)
        self._failures += 1
        self._address = (self._address + 1) % len(self._stubs)
        stub = self._stubs[self._address]
        remaining = None if self._deadline is None else max(0.0, self._deadline - self._clock())
        self._first_call = False
        # wait_for_ready=False: an address that is down fails at once and the next one is tried.
        if self._next_index == 0:
            self._call = stub.Generate(self._request, timeout=remaining, wait_for_ready=False)
        else:
            resume = generation_pb2.ResumeRequest(request_id=self.request_id, from_index=self._next_index)
            self._call = stub.Resume(resume, timeout=remaining, wait_for_ready=False)
