"""The HTTP front's Generate stream across a broken call (openai_api/engine_client.py), on scripted calls:
re-attached with Resume from the next index, each message once; the abort it owes after a re-attachment;
errors that are not UNAVAILABLE, and a scheduler that never comes back, end the stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmserve.resume import ResumePolicy
from openai_api.engine_client import GenerationStream
from openai_api.errors import OpenAIError
from protos import generation_pb2

FAST = ResumePolicy(initial_backoff_s=0.001, max_backoff_s=0.002, max_wait_s=5.0)


def _msg(index: int, last: bool = False) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(request_id="r", index=index)
    if last:
        msg.usage.completion_tokens = index + 1
    return msg


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name.lower())


class _Call:
    """A call that answers its script in order, then waits until it is cancelled."""

    def __init__(self, *script: object) -> None:
        self.script, self.cancelled = list(script), False

    async def read(self) -> object:
        if not self.script:
            await asyncio.Event().wait()
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Stub:
    def __init__(self, *resumed: _Call) -> None:
        self.resumed, self.resumes, self.aborts = list(resumed), [], []

    def Resume(self, request: generation_pb2.ResumeRequest, wait_for_ready: bool) -> _Call:  # noqa: N802
        self.resumes.append((request.request_id, request.from_index))
        return self.resumed.pop(0)

    async def Abort(self, request: generation_pb2.AbortRequest, timeout: float) -> None:  # noqa: N802
        self.aborts.append(request.request_id)


async def _read(stream: GenerationStream) -> list[int]:
    return [msg.index async for msg in stream]


async def _read_then_leave(stream: GenerationStream, count: int) -> list[int]:
    """Reads `count` messages, then cancels the stream as the front does when its HTTP client goes away."""
    messages = stream.__aiter__()
    got = [(await messages.__anext__()).index for _ in range(count)]
    stream.cancel()
    await asyncio.sleep(0)  # an abort it owes runs now
    await messages.aclose()
    return got


def test_a_broken_stream_resumes_at_its_next_index_until_a_scheduler_answers() -> None:
    unavailable = _error(grpc.StatusCode.UNAVAILABLE)
    stub = _Stub(_Call(unavailable), _Call(_msg(2), _msg(3, last=True)))
    stream = GenerationStream(stub, "r", _Call(_msg(1), unavailable), _msg(0), FAST)  # type: ignore[arg-type]
    assert asyncio.run(_read(stream)) == [0, 1, 2, 3]
    # The first Resume found no scheduler; the second answered. The request finished: nothing to abort.
    assert stub.resumes == [("r", 2), ("r", 2)] and stub.aborts == []


def test_a_stream_left_after_a_reattachment_aborts_its_request() -> None:
    resumed = _Call(_msg(1))
    stub = _Stub(resumed)
    original = _Call(_error(grpc.StatusCode.UNAVAILABLE))
    stream = GenerationStream(stub, "r", original, _msg(0), FAST)  # type: ignore[arg-type]
    assert asyncio.run(_read_then_leave(stream, 2)) == [0, 1]
    # The call that admitted the request is gone, so the scheduler would not abort it by itself.
    assert stub.aborts == ["r"] and resumed.cancelled


def test_a_stream_left_while_it_waits_to_reattach_aborts_its_request() -> None:
    stub = _Stub()
    broken = _Call(_error(grpc.StatusCode.UNAVAILABLE))
    slow = ResumePolicy(initial_backoff_s=30.0, max_backoff_s=30.0, max_wait_s=60.0)
    stream = GenerationStream(stub, "r", broken, _msg(0), slow)  # type: ignore[arg-type]

    async def leave_during_the_backoff() -> None:
        reading = asyncio.ensure_future(_read(stream))
        while broken.script:  # until the call broke (the stream then waits its backoff)
            await asyncio.sleep(0)
        reading.cancel()  # the front cancels the reading task when its HTTP client goes away
        await asyncio.gather(reading, return_exceptions=True)
        await asyncio.sleep(0)  # the abort runs

    asyncio.run(leave_during_the_backoff())
    assert stub.aborts == ["r"] and stub.resumes == []


def test_a_stream_left_before_any_break_leaves_the_abort_to_the_scheduler() -> None:
    stub = _Stub()
    call = _Call(_msg(1))
    stream = GenerationStream(stub, "r", call, _msg(0), FAST)  # type: ignore[arg-type]
    assert asyncio.run(_read_then_leave(stream, 2)) == [0, 1]
    assert call.cancelled and stub.aborts == [] and stub.resumes == []


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_other_errors_end_the_stream_without_a_reattachment(code: grpc.StatusCode) -> None:
    stub = _Stub()
    stream = GenerationStream(stub, "r", _Call(_error(code)), _msg(0), FAST)  # type: ignore[arg-type]
    with pytest.raises(OpenAIError):
        asyncio.run(_read(stream))
    assert stub.resumes == []


def test_a_scheduler_that_never_answers_ends_the_stream_after_the_policy_wait() -> None:
    unavailable = _error(grpc.StatusCode.UNAVAILABLE)
    policy = ResumePolicy(initial_backoff_s=0.001, max_backoff_s=0.002, max_wait_s=0.05)
    stub = _Stub(*[_Call(unavailable) for _ in range(200)])
    stream = GenerationStream(stub, "r", _Call(unavailable), _msg(0), policy)  # type: ignore[arg-type]
    with pytest.raises(OpenAIError) as info:
        asyncio.run(_read(stream))
    assert info.value.status == 503 and 1 <= len(stub.resumes) < 200
