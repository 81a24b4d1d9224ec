"""The engine loop's calls to its worker, over one long-lived StreamSteps stream.

A unary call per step sets up an HTTP/2 stream, sends headers, message and trailers, and on the
worker's side waits for the call, then for its message, each a turn of gRPC's poller and event loop.
On one stream a step is one message each way. Measured on 2 cores (steady decode, default model,
`benchmarks/overhead.py`): the plan reached the worker ~1.1 ms after it was sent as a unary call, ~0.4
ms as a message; the step's round trip beyond the worker's own time fell by ~0.5-1.2 ms at 1 to 64
sequences (docs/benchmarks-history.md). vLLM's engine core talks to its workers over long-lived
sockets for the same reason.

What a unary call gave for free is kept here: each call has its own deadline (from its sending: a
step sent behind another waits for it, as a unary call did), and its failure is a grpc.aio.AioRpcError
with the status the worker ended the stream with (or DEADLINE_EXCEEDED / CANCELLED when the loop gave
up on it). A failed step ends the stream; the next call opens a new one.

Answers come back in the order the calls were sent, and the loop lands its calls in that order, so
each call reads exactly the next answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Mapping

import grpc

from protos import worker_pb2, worker_pb2_grpc


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StepCall:
    """One call on the stream: awaiting it gives its StepBatchResult or raises grpc.aio.AioRpcError."""

    def __init__(self, call: grpc.aio.StreamStreamCall, deadline: float) -> None:
        self._call = call
        self._deadline = deadline  # the event loop's time
        self._gave_up: grpc.aio.AioRpcError | None = None

    def __await__(self) -> Generator[object, None, worker_pb2.StepBatchResult]:
        return self._answer().__await__()

    def cancel(self) -> None:
        """Gives up on the call, and with it on the stream (the steps it carried still run on the worker)."""
        self._give_up(grpc.StatusCode.CANCELLED, "the engine loop cancelled the step")

    def _give_up(self, code: grpc.StatusCode, details: str) -> None:
        if self._gave_up is None:
            self._gave_up = _rpc_error(code, details)
        self._call.cancel()

    async def _answer(self) -> worker_pb2.StepBatchResult:
        if self._gave_up is not None:
            raise self._gave_up
        try:
            async with asyncio.timeout_at(self._deadline):
                answer = await self._call.read()
        except TimeoutError:
            self._give_up(grpc.StatusCode.DEADLINE_EXCEEDED, "the worker did not answer the step within its deadline")
            raise self._gave_up from None  # type: ignore[misc]
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the loop itself is cancelled
            # The stream was cancelled here (this call or one beside it gave up): grpc reports that as a
            # cancellation of whoever reads next.
            raise self._gave_up or _rpc_error(grpc.StatusCode.CANCELLED, "the step stream was cancelled") from None
        if answer is grpc.aio.EOF:
            # The stream ended without an error and this call unanswered: only after the caller half-closes it.
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker closed the step stream")
        return answer


class StepStream:
    """Sends the engine loop's calls on one stream, opened at the first call and again after a failure."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self._stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None

    async def send(self, plans: list[worker_pb2.StepPlan], timeout: float,
                   trace_context: Mapping[str, str]) -> StepCall:
        """Writes a call's plans (one step, or several under multi-step scheduling); `timeout` in seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        if self._call is None or self._call.done():
            self._call = self._stub.StreamSteps()
        call = self._call
        try:
            await call.write(worker_pb2.StepBatch(steps=plans, trace_context=trace_context))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream has failed: reading the answer raises its status
        return StepCall(call, deadline)

    def close(self) -> None:
        """Ends the stream (a step running on the worker runs to its end)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
