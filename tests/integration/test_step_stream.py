"""The engine loop's step stream (scheduler_service/step_stream.py) against the worker's servicer over localhost gRPC.

The servicer is the real one, its model runner a stand-in that answers each plan with its step id (and
fails or waits on the step ids the tests choose): what is tested is the stream, not the model.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos import worker_pb2, worker_pb2_grpc
from scheduler_service.step_stream import StepStream
from shared import grpc_server
from shared.tracing import trace_carrier
from worker_service.model_runner import StepOutput
from worker_service.model_thread import ModelThread
from worker_service.servicer import WorkerServicer

FAILING_STEP = 66  # the stand-in raises a bug of its own (not a request error)
SLOW_STEP = 99  # waits for the test's gate
DEADLINE_S = 60.0


class _Seqs:
    def num_used_blocks(self) -> int:
        return 0


class _Runner:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.ran: list[int] = []
        self.seqs = _Seqs()  # a recording span's attributes read it

    def execute(self, plan: Any, wire: Any = None) -> StepOutput:
        if wire.step_id == SLOW_STEP:
            assert self.gate.wait(60), "the test never opened the gate"
        if wire.step_id == FAILING_STEP:
            raise RuntimeError("an invariant broke")
        self.ran.append(wire.step_id)
        return StepOutput(wire.step_id, [], 0.001)


def _plans(epoch: int, *step_ids: int) -> list[worker_pb2.StepPlan]:
    return [worker_pb2.StepPlan(epoch=epoch, step_id=s) for s in step_ids]


async def _serving(runner: _Runner, model_thread: ModelThread, tracer: trace.Tracer | None
                   ) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server = grpc_server.create_server()
    servicer = WorkerServicer(runner, model_name="m", tracer=tracer, model_thread=model_thread)  # type: ignore[arg-type]
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def _run(scenario: Any, tracer: trace.Tracer | None = None) -> _Runner:
    """Runs `scenario(stream, runner)` against a served stand-in worker; returns the runner."""
    runner, model_thread = _Runner(), ModelThread()

    async def main() -> None:
        server, channel = await _serving(runner, model_thread, tracer)
        stream = StepStream(worker_pb2_grpc.WorkerStub(channel))
        try:
            await scenario(stream, runner)
        finally:
            stream.close()
            runner.gate.set()
            await channel.close()
            await server.stop(None)

    try:
        asyncio.run(main())
    finally:
        model_thread.shutdown()
    return runner


async def _step_ids(call: Any) -> list[int]:
    return [r.step_id for r in (await call).results]


def test_calls_sent_ahead_are_answered_in_order() -> None:
    async def scenario(stream: StepStream, runner: _Runner) -> None:
        # As async and multi-step scheduling send them: the next call before the one ahead is answered.
        calls = [await stream.send(_plans(1, 1), DEADLINE_S, {}), await stream.send(_plans(1, 2, 3), DEADLINE_S, {}),
                 await stream.send(_plans(1, 4), DEADLINE_S, {})]
        assert [await _step_ids(c) for c in calls] == [[1], [2, 3], [4]]

    assert _run(scenario).ran == [1, 2, 3, 4]


@pytest.mark.parametrize(("plans", "code", "details"), [
    (_plans(3, 7), grpc.StatusCode.FAILED_PRECONDITION, "epoch 3 is older than the current epoch 5"),
    ([], grpc.StatusCode.INVALID_ARGUMENT, "a step batch holds no plan"),
    (_plans(5, FAILING_STEP), grpc.StatusCode.INTERNAL, "an invariant broke"),
])
def test_a_failed_call_raises_its_status_and_the_next_call_opens_a_new_stream(
        plans: list[worker_pb2.StepPlan], code: grpc.StatusCode, details: str) -> None:
    async def scenario(stream: StepStream, runner: _Runner) -> None:
        assert await _step_ids(await stream.send(_plans(5, 1), DEADLINE_S, {})) == [1]
        failed = await stream.send(plans, DEADLINE_S, {})
        behind = await stream.send(_plans(5, 2), DEADLINE_S, {})  # written before the failure was known
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await failed
        assert info.value.code() == code and details in (info.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError):
            await behind  # its stream has ended: its answer never comes on it
        assert await _step_ids(await stream.send(_plans(5, 3), DEADLINE_S, {})) == [3]

    # The call written behind the failed one ran, unanswered, if it reached the worker before the stream ended.
    assert _run(scenario).ran in ([1, 3], [1, 2, 3])


def test_a_call_past_its_deadline_is_deadline_exceeded() -> None:
    async def scenario(stream: StepStream, runner: _Runner) -> None:
        slow = await stream.send(_plans(1, SLOW_STEP), 0.2, {})
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await slow
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        runner.gate.set()
        assert await _step_ids(await stream.send(_plans(1, 1), DEADLINE_S, {})) == [1]

    # The step that outlived its caller still ran, before the next.
    assert _run(scenario).ran == [SLOW_STEP, 1]


def test_a_cancelled_call_is_cancelled_not_the_loop() -> None:
    async def scenario(stream: StepStream, runner: _Runner) -> None:
        slow = await stream.send(_plans(1, SLOW_STEP), DEADLINE_S, {})
        behind = await stream.send(_plans(1, 1), DEADLINE_S, {})
        behind.cancel()  # the engine loop gives up on the step behind a failed one
        for call in (slow, behind):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.CANCELLED

    _run(scenario)


def test_the_trace_context_reaches_the_workers_span() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    step = tracer.start_span("llmserve.step")

    async def scenario(stream: StepStream, runner: _Runner) -> None:
        assert await _step_ids(await stream.send(_plans(1, 1), DEADLINE_S, trace_carrier(step))) == [1]

    _run(scenario, tracer)
    step.end()
    (worker,) = [s for s in memory.get_finished_spans() if s.name == "llmserve.worker.execute_step"]
    assert worker.parent is not None and worker.parent.span_id == step.get_span_context().span_id
