"""The worker's model thread: every call on one thread, the caller's context with it, errors raised to the caller."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import pytest

from protos import worker_pb2
from worker_service.model_thread import ModelThread
from worker_service.servicer import WorkerServicer

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def test_calls_run_on_one_thread_that_is_not_the_callers() -> None:
    model_thread = ModelThread()

    async def scenario() -> set[int]:
        return {await model_thread.call(threading.get_ident) for _ in range(5)}

    try:
        idents = asyncio.run(scenario())
        idents.add(model_thread.run(threading.get_ident))
    finally:
        model_thread.shutdown()
    assert len(idents) == 1
    assert threading.get_ident() not in idents


def test_call_carries_the_callers_context_and_raises_its_errors() -> None:
    model_thread = ModelThread()

    def fail() -> None:
        raise ValueError("bad plan")

    async def scenario() -> str:
        _request_id.set("req-7")
        seen = await model_thread.call(_request_id.get)
        with pytest.raises(ValueError, match="bad plan"):
            await model_thread.call(fail)
        return seen

    try:
        assert asyncio.run(scenario()) == "req-7"
    finally:
        model_thread.shutdown()


class _Runner:
    """Stands in for the ModelRunner: records the thread each step runs on."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def execute(self, plan: Any, wire: Any = None) -> Any:
        self.threads.append(threading.get_ident())
        raise RuntimeError("no model here")  # the servicer turns it into a status; the thread is what counts


class _Context:
    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(details)


async def _call(servicer: WorkerServicer, step_id: int) -> None:
    """One call of one plan on a stream of its own, as an engine loop sends it."""
    async def requests() -> Any:
        yield worker_pb2.StepBatch(steps=[worker_pb2.StepPlan(step_id=step_id, epoch=1)])

    async for _ in servicer.StreamSteps(requests(), _Context()):  # type: ignore[arg-type]
        pass


def test_servicer_runs_steps_on_the_model_thread_it_was_given() -> None:
    model_thread = ModelThread()
    loaded_on = model_thread.run(threading.get_ident)  # as serve() loads the model there
    runner = _Runner()
    servicer = WorkerServicer(runner, model_name="m", model_thread=model_thread)  # type: ignore[arg-type]

    async def scenario() -> None:
        for step in range(3):
            with pytest.raises(RuntimeError):
                await _call(servicer, step)

    try:
        asyncio.run(scenario())
    finally:
        model_thread.shutdown()
    assert runner.threads == [loaded_on] * 3


class _GatedRunner:
    """Stands in for the ModelRunner: step 1 waits for a gate; every step's id is recorded as it runs."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.ran: list[int] = []

    def execute(self, plan: Any, wire: Any = None) -> Any:
        if wire.step_id == 1:
            self.started.set()
            assert self.gate.wait(60), "the test never opened the gate"
        self.ran.append(wire.step_id)
        raise RuntimeError("no model here")  # what the servicer returns is not what this test is about


def test_a_call_that_reached_the_worker_runs_in_its_turn_after_the_stream_ends(caplog: pytest.LogCaptureFixture) -> None:
    # A scheduler replica killed with step 2 sent behind step 1 (async scheduling) and step 1 unanswered: its stream
    # ends, but the stored state counts step 1 as run and step 2 as planned, and the worker had received both: it
    # runs them, for the next owner to land their results.
    model_thread = ModelThread()
    runner = _GatedRunner()
    servicer = WorkerServicer(runner, model_name="m", model_thread=model_thread)  # type: ignore[arg-type]

    async def scenario() -> None:
        delivered = asyncio.Event()

        async def requests() -> Any:
            for step_id in (1, 2):
                yield worker_pb2.StepBatch(steps=[worker_pb2.StepPlan(step_id=step_id, epoch=1)])
            delivered.set()  # asked for a third: the second has been taken
            await asyncio.Event().wait()  # the stream stays open until its caller goes

        async def consume() -> None:
            async for _ in servicer.StreamSteps(requests(), _Context()):  # type: ignore[arg-type]
                pass

        stream = asyncio.ensure_future(consume())
        # A worker that took step 2 only after answering step 1 never asks for a third.
        await asyncio.wait_for(delivered.wait(), 60)
        assert await asyncio.to_thread(runner.started.wait, 60)
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream
        runner.gate.set()
        with pytest.raises(RuntimeError):
            await _call(servicer, 3)

    try:
        asyncio.run(scenario())
    finally:
        model_thread.shutdown()
    assert runner.ran == [1, 2, 3]
    assert sum("a step whose caller had gone failed: no model here" in r.getMessage() for r in caplog.records) == 2
