"""Liveness and readiness: what each service reports, and how it reaches grpc.health.v1.

The inputs are stand-ins with the same attributes as the real ones (an engine loop's is_idle and
last_progress, the router's num_workers, the store's ping); the decision itself is pure and tested
in test_liveness.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health, health_pb2

from llmserve.cli import _SCHEDULER_PASS, _WORKER_PASS, _passthrough, build_parser
from scheduler_service.config import SchedulerServiceConfig
from scheduler_service.health import SchedulerHealth
from shared.health_probes import LIVENESS, READINESS, HealthReporter, HealthState, watch_health
from shared.liveness import Activity
from worker_service.config import WorkerConfig
from worker_service.health import WorkerHealth
from worker_service.servicer import WorkerServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class FakeLoop:
    worker_id: str
    is_idle: bool
    last_progress: float


@dataclass
class FakeRouter:
    num_workers: int


class FakeStore:
    def __init__(self, answers: bool = True, hangs: bool = False) -> None:
        self.answers, self.hangs = answers, hangs

    async def ping(self) -> None:
        if self.hangs:
            await asyncio.sleep(60)
        if not self.answers:
            raise ConnectionError("Redis is away")


def scheduler_health(loops: list[FakeLoop], workers: int = 1, store: FakeStore | None = None,
                     timeout_s: float = 5.0) -> HealthState:
    checks = SchedulerHealth(lambda: loops, FakeRouter(workers), store or FakeStore(),  # type: ignore[arg-type]
                             liveness_timeout_s=timeout_s, ping_timeout_s=0.2)
    return asyncio.run(checks.evaluate())


def test_scheduler_idle_loops_are_live_however_old_their_last_step() -> None:
    state = scheduler_health([FakeLoop("w0", is_idle=True, last_progress=0.0)])
    assert state == HealthState(live=True, ready=True, reason="")


def test_scheduler_loop_with_work_and_no_step_past_the_timeout_is_not_live() -> None:
    now = time.monotonic()
    loops = [FakeLoop("w0", is_idle=False, last_progress=now - 1.0),
             FakeLoop("w1", is_idle=False, last_progress=now - 30.0)]
    state = scheduler_health(loops)
    assert not state.live and state.ready
    assert "worker w1" in state.reason and "w0" not in state.reason and "--liveness-timeout 5s" in state.reason
    assert scheduler_health(loops[:1]).live


def test_scheduler_is_not_ready_without_redis_or_without_a_routable_worker() -> None:
    loops: list[FakeLoop] = []
    assert scheduler_health(loops, workers=2, store=FakeStore(answers=False)).ready is False
    hung = scheduler_health(loops, store=FakeStore(hangs=True))
    assert not hung.ready and "within 0.2s" in hung.reason
    no_worker = scheduler_health(loops, workers=0)
    assert not no_worker.ready and no_worker.live and "no routable worker" in no_worker.reason


def test_worker_liveness_follows_the_running_step() -> None:
    step = Activity(has_work=False, last_progress=0.0)
    checks = WorkerHealth(lambda: step, liveness_timeout_s=5.0)
    assert asyncio.run(checks.evaluate()) == HealthState(live=True, ready=True)
    step = Activity(has_work=True, last_progress=time.monotonic() - 1.0)
    assert asyncio.run(checks.evaluate()).live
    step = Activity(has_work=True, last_progress=time.monotonic() - 6.0)
    stuck = asyncio.run(checks.evaluate())
    assert not stuck.live and stuck.ready and "a step has been executing" in stuck.reason


def test_worker_is_ready_once_registered_and_not_while_draining() -> None:
    registered = False
    checks = WorkerHealth(lambda: Activity(False, 0.0), 5.0, registered=lambda: registered)
    assert not asyncio.run(checks.evaluate()).ready
    registered = True
    assert asyncio.run(checks.evaluate()).ready
    checks.stopping = True
    draining = asyncio.run(checks.evaluate())
    assert draining.live and not draining.ready and "draining" in draining.reason


class _Runner:
    """Stands in for the ModelRunner: records what the servicer reports while a step executes."""

    def __init__(self) -> None:
        self.servicer: WorkerServicer | None = None
        self.seen: Activity | None = None

    def execute(self, plan: Any, wire: Any = None) -> str:
        assert self.servicer is not None
        self.seen = self.servicer.step_activity
        return "out"


def test_worker_servicer_reports_a_step_only_while_it_executes() -> None:
    runner = _Runner()
    servicer = WorkerServicer(runner, model_name="m")  # type: ignore[arg-type]
    runner.servicer = servicer
    assert not servicer.step_activity.has_work
    before = time.monotonic()
    assert servicer._execute([None], [None]) == ["out"]  # type: ignore[list-item]  # noqa: SLF001
    assert runner.seen is not None and runner.seen.has_work and runner.seen.last_progress >= before
    assert not servicer.step_activity.has_work


async def _statuses(servicer: health.aio.HealthServicer, names: list[str]) -> dict[str, int]:
    out = {}
    for name in names:
        reply = await servicer.Check(health_pb2.HealthCheckRequest(service=name), None)
        out[name] = reply.status
    return out


def test_reporter_sets_liveness_apart_from_readiness_and_its_aliases() -> None:
    names = ["", READINESS, "llmserve.v1.Generation", LIVENESS]

    async def scenario() -> list[dict[str, int]]:
        servicer = health.aio.HealthServicer()
        reporter = HealthReporter(servicer, ["llmserve.v1.Generation"])
        seen = []
        for state in (HealthState(True, True), HealthState(False, True, "stuck"), HealthState(True, False, "no Redis")):
            await reporter.set(state)
            seen.append(await _statuses(servicer, names))
        return seen

    first, stalled, unready = asyncio.run(scenario())
    assert first == dict.fromkeys(names, SERVING)
    assert stalled == {**dict.fromkeys(names, SERVING), LIVENESS: NOT_SERVING}
    assert unready == {**dict.fromkeys(names, NOT_SERVING), LIVENESS: SERVING}


def test_watch_survives_a_failing_evaluation_and_stops_on_request() -> None:
    async def scenario() -> tuple[int, HealthState | None]:
        servicer = health.aio.HealthServicer()
        reporter = HealthReporter(servicer, [])
        stop = asyncio.Event()
        calls = 0

        async def evaluate() -> HealthState:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug in a check")
            if calls == 3:
                stop.set()
            return HealthState(live=True, ready=calls < 3)

        await asyncio.wait_for(watch_health(reporter, evaluate, 0.01, stop), 5)
        return calls, reporter.state

    calls, state = asyncio.run(scenario())
    assert calls == 3 and state == HealthState(live=True, ready=False)


def test_liveness_timeouts_are_validated_and_flagged(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="liveness_timeout_s must be positive, got 0"):
        SchedulerServiceConfig(tokenizer="t", redis_url="redis://r:6379/0", liveness_timeout_s=0)
    with pytest.raises(ValueError, match="output_retention_s must be at least 1 second, got 0"):
        SchedulerServiceConfig(tokenizer="t", redis_url="redis://r:6379/0", output_retention_s=0)
    with pytest.raises(ValueError, match="liveness_timeout_s must be positive, got -1"):
        WorkerConfig(model=str(tmp_path), liveness_timeout_s=-1)
    assert SchedulerServiceConfig(tokenizer="t", redis_url="redis://r").liveness_timeout_s > \
        SchedulerServiceConfig(tokenizer="t", redis_url="redis://r").step_timeout_s
    parser = build_parser()
    assert parser.parse_args(["scheduler", "--redis-url", "redis://r", "--liveness-timeout", "90"]).liveness_timeout == 90
    assert parser.parse_args(["worker", "--liveness-timeout", "120"]).liveness_timeout == 120
    up = parser.parse_args(["up", "--liveness-timeout", "45"])
    for forwarded in (_passthrough(up, _WORKER_PASS), _passthrough(up, _SCHEDULER_PASS)):
        assert float(forwarded[forwarded.index("--liveness-timeout") + 1]) == 45
