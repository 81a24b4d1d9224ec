"""The client's resuming stream against scripted stubs: when it re-attaches, where, with what, how long."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from llmserve.client import make_request
from llmserve.resume import ResumePolicy, ResumingStream
from protos import generation_pb2


class FakeError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "no worker is ready" if self._code == grpc.StatusCode.UNAVAILABLE else ""


@dataclass
class FakeCall:
    """A server-streaming call: its messages, then an error (or the end)."""

    items: list[generation_pb2.GenerateResponse | FakeError]
    cancelled: bool = False
    _it: Iterator[generation_pb2.GenerateResponse | FakeError] | None = None

    def __iter__(self) -> "FakeCall":
        return self

    def __next__(self) -> generation_pb2.GenerateResponse:
        if self._it is None:
            self._it = iter(self.items)
        if self.cancelled:
            raise FakeError(grpc.StatusCode.CANCELLED)
        item = next(self._it)
        if isinstance(item, FakeError):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeStub:
    """One address: answers each call with the next scripted FakeCall and records what was asked."""

    name: str
    log: list[tuple[str, str, object, bool]]
    script: list[FakeCall] = field(default_factory=list)

    def Generate(self, request, timeout=None, wait_for_ready=False):  # noqa: N802 - gRPC's method name
        self.log.append((self.name, "Generate", request.request_id, wait_for_ready))
        return self.script.pop(0)

    def Resume(self, request, timeout=None, wait_for_ready=False):  # noqa: N802
        self.log.append((self.name, "Resume", (request.request_id, request.from_index), wait_for_ready))
        return self.script.pop(0)

    def Abort(self, request, timeout=None):  # noqa: N802
        self.log.append((self.name, "Abort", request.request_id, False))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


UNAVAILABLE = FakeError(grpc.StatusCode.UNAVAILABLE)


def msg(index: int, token: int, final: bool = False) -> generation_pb2.GenerateResponse:
    m = generation_pb2.GenerateResponse(request_id="r", index=index,
                                        outputs=[generation_pb2.CompletionDelta(token_ids=[token])])
    if final:
        m.usage.completion_tokens = 1
    return m


def make(scripts: list[list[FakeCall]], request=None, timeout: float | None = None,
         policy: ResumePolicy | None = None) -> tuple[ResumingStream, list, FakeClock]:
    log: list[tuple[str, str, object, bool]] = []
    stubs = [FakeStub(f"a{i}", log, script) for i, script in enumerate(scripts)]
    clock = FakeClock()
    stream = ResumingStream(stubs, request or make_request(request_id="r", prompt="hi"), timeout,  # type: ignore[arg-type]
                            policy or ResumePolicy(), sleep=clock.sleep, clock=clock)
    return stream, log, clock


def test_a_broken_stream_resumes_at_its_next_index_on_the_next_address() -> None:
    stream, log, clock = make([
        [FakeCall([msg(0, 10), msg(1, 11), UNAVAILABLE])],
        [FakeCall([msg(2, 12), msg(3, 13, final=True)])],
    ])
    assert [m.index for m in stream] == [0, 1, 2, 3]
    assert log == [("a0", "Generate", "r", True), ("a1", "Resume", ("r", 2), False)]
    assert clock.slept == [0.1] and stream.next_index == 4


def test_a_stream_broken_before_any_message_sends_the_same_request_again() -> None:
    request = make_request(prompt="hi")  # no id: the stream names it, so the re-sent call is the same request
    stream, log, _ = make([[FakeCall([UNAVAILABLE]), FakeCall([msg(0, 1), msg(1, 2, final=True)])]], request=request)
    assert [m.index for m in stream] == [0, 1]
    ids = {entry[2] for entry in log}
    assert [entry[1] for entry in log] == ["Generate", "Generate"] and len(ids) == 1
    assert stream.request_id in ids and len(stream.request_id) == 32
    assert request.request_id == ""  # the caller's message is left alone


def test_a_message_seen_before_the_break_is_not_repeated() -> None:
    stream, _, _ = make([[FakeCall([msg(0, 1), UNAVAILABLE]), FakeCall([msg(0, 1), msg(1, 2, final=True)])]])
    assert [m.index for m in stream] == [0, 1]


def test_a_call_that_breaks_after_its_final_message_ends_the_stream_whole() -> None:
    # The scheduler died after sending the last message (the one with usage) but before the call's status:
    # the response is complete, so the stream ends without an error and without a re-attachment.
    stream, log, clock = make([[FakeCall([msg(0, 1), msg(1, 2, final=True), UNAVAILABLE])]])
    assert [m.index for m in stream] == [0, 1]
    assert len(log) == 1 and clock.slept == []


def test_other_errors_are_raised_at_once() -> None:
    stream, log, clock = make([[FakeCall([msg(0, 1), FakeError(grpc.StatusCode.NOT_FOUND)])]])
    assert next(stream).index == 0
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and len(log) == 1 and clock.slept == []


def test_it_backs_off_and_gives_up_after_max_wait_without_a_deadline(caplog: pytest.LogCaptureFixture) -> None:
    policy = ResumePolicy(initial_backoff_s=0.5, max_backoff_s=2.0, max_wait_s=6.0)
    stream, log, clock = make([[FakeCall([msg(0, 1), UNAVAILABLE])] + [FakeCall([UNAVAILABLE]) for _ in range(10)]],
                              policy=policy)
    next(stream)
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # 0.5 + 1 + 2 + 2 = 5.5 s; a further 2 s would pass max_wait_s.
    assert clock.slept == [0.5, 1.0, 2.0, 2.0]
    assert [entry[1:3] for entry in log[1:]] == [("Resume", ("r", 1))] * 4
    # The caller is told once why it waits, not at every retry.
    assert [r.getMessage() for r in caplog.records if r.name == "llmserve.resume"] == [
        "request r: UNAVAILABLE (no worker is ready); retrying for up to 6 s"]


def test_it_gives_up_at_the_call_deadline_and_passes_the_time_left() -> None:
    seen: list[float | None] = []
    stream, log, clock = make([[FakeCall([msg(0, 1), UNAVAILABLE])] + [FakeCall([UNAVAILABLE]) for _ in range(10)]],
                              timeout=1.0)
    stub = stream._stubs[0]  # noqa: SLF001 - observe the timeouts the re-attachments get
    original = stub.Resume

    def resume(request, timeout=None, wait_for_ready=False):
        seen.append(timeout)
        return original(request, timeout, wait_for_ready)

    stub.Resume = resume  # type: ignore[method-assign]
    next(stream)
    with pytest.raises(grpc.RpcError):
        next(stream)
    assert clock.slept == [0.1, 0.2, 0.4]  # a further 0.8 s would pass the 1 s deadline
    assert seen == pytest.approx([0.9, 0.7, 0.3])


def test_cancel_aborts_a_non_resumable_request_only_once_its_admitting_call_is_gone() -> None:
    stream, log, _ = make([[FakeCall([msg(0, 1), msg(1, 2)])]])
    next(stream)
    stream.cancel()  # the admitting call: the server aborts the request when it ends
    assert [entry[1] for entry in log] == ["Generate"]
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED

    stream, log, _ = make([[FakeCall([msg(0, 1), UNAVAILABLE]), FakeCall([msg(1, 2), msg(2, 3)])]])
    next(stream), next(stream)
    stream.cancel()  # a Resume call: nobody else would abort it
    assert [entry[1:3] for entry in log] == [("Generate", "r"), ("Resume", ("r", 1)), ("Abort", "r")]

    resumable = make_request(request_id="r", prompt="hi")
    resumable.resumable = True
    stream, log, _ = make([[FakeCall([msg(0, 1), UNAVAILABLE]), FakeCall([msg(1, 2)])]], request=resumable)
    next(stream), next(stream)
    stream.cancel()  # resumable: it keeps running for a later Resume
    assert [entry[1] for entry in log] == ["Generate", "Resume"]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(initial_backoff_s=0), "initial_backoff_s must be positive, got 0"),
    (dict(initial_backoff_s=1.0, max_backoff_s=0.5), "max_backoff_s must be at least initial_backoff_s (1.0), got 0.5"),
    (dict(max_wait_s=-1), "max_wait_s must be positive, got -1"),
])
def test_policy_values_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ResumePolicy(**kwargs)
    assert str(info.value) == message
