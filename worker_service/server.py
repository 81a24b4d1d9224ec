"""Starts a worker: load the model, size the cache, serve the Worker API.

Start-up, each phase timed for the `worker ready in ...` line (shared/startup_timer.py):

    imports (the CLI's) ─▶ kernels ─▶ model (runner: weights, KV cache) ─▶ server ─▶ heap ─▶ registration ─▶ ready

heap: the start-up heap frozen (shared/startup_heap.py), in `llmserve worker` only.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import torch

from llmserve.kernels import get_backend
from protos import worker_pb2, worker_pb2_grpc
from shared import grpc_server, redis_client
from shared.health_probes import HealthReporter, watch_health
from shared.metrics import MetricsServer, WorkerMetrics
from shared.startup_heap import settle_startup_heap
from shared.startup_timer import NUMBA_COMPILE_NOTE, StartupReport, StartupTimer
from shared.tls import bind, describe
from shared.tracing import TracingConfig, make_tracer
from worker_service.config import WorkerConfig
from worker_service.health import WorkerHealth
from worker_service.model_thread import ModelThread
from shared.worker_registry import WorkerRegistry
from worker_service.tp_ranks import start_runner
from worker_service.registration import Registration, RegistrationConfig
from worker_service.servicer import WorkerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# How often liveness and readiness are re-evaluated (at most; a third of a short liveness timeout).
# Cheap (no I/O), so often: readiness follows the first heartbeat closely.
HEALTH_PERIOD_SECONDS = 0.25


async def serve(config: WorkerConfig, host: str, port: int, ready: asyncio.Event | None = None,
                registration: RegistrationConfig | None = None, startup: StartupTimer | None = None,
                on_ready: Callable[[StartupReport], None] | None = None) -> None:
    """Runs the worker until SIGINT/SIGTERM (or cancellation).

    registration: register in Redis so that schedulers find this worker, and drain on SIGTERM.
    startup: the timer of this process's start-up (the CLI starts it before its imports); on_ready is
    called with its report once the worker is ready (health SERVING: registered when it registers).
    """
    timer = startup if startup is not None else StartupTimer()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    # Kernels, model and steps on one thread: one OpenMP thread team (model_thread.py).
    model_thread = ModelThread()
    # Kernels first, on their own: loading them from Numba's cache is a cost of its own, and the runner's
    # get_backend() then finds them loaded (the backend is cached per device type).
    with timer.phase("kernels", note=NUMBA_COMPILE_NOTE):
        await model_thread.call(get_backend, config.device)
    # With --tensor-parallel-size N this process is rank 0; ranks 1..N-1 are its subprocesses.
    with timer.phase("model", note=f"it loads the weights, and {NUMBA_COMPILE_NOTE}"):
        runner, ranks = await model_thread.call(start_runner, config)
    server_started = timer.elapsed()
    tracer, provider = make_tracer(TracingConfig.from_env("llmserve-worker", config.otlp_endpoint, config.trace_file))
    metrics = WorkerMetrics(Path(config.model).name or config.model) if config.metrics_port else None
    servicer = WorkerServicer(runner, model_name=config.model, tracer=tracer, metrics=metrics, model_thread=model_thread)
    server = grpc_server.create_server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = grpc_server.add_health_and_reflection(server, [SERVICE_NAME])
    bound = bind(server, host, port, config.tls, "worker")
    log.info("Worker API over %s", describe(config.tls))
    if config.tls is not None and not config.tls.mutual:
        log.warning("the Worker API uses TLS without --tls-client-ca-file: any client can send it plans; "
                    "set it for mutual TLS")
    metrics_server = MetricsServer(metrics.registry, config.metrics_port, host) if metrics is not None else None
    registered: Registration | None = None

    def is_registered() -> bool:
        # Late-bound: the registration starts once the server serves.
        return registered is not None and registered.registered

    checks = WorkerHealth(lambda: servicer.step_activity, config.liveness_timeout_s,
                          is_registered if registration is not None else None)
    reporter = HealthReporter(health, [SERVICE_NAME])
    await reporter.set(await checks.evaluate())  # before the first probe can arrive
    health_stop = asyncio.Event()
    watcher = asyncio.create_task(watch_health(reporter, checks.evaluate, min(HEALTH_PERIOD_SECONDS,
                                               config.liveness_timeout_s / 3), health_stop), name="health")
    await server.start()
    log.info(
        "worker serving %s on %s:%d (%d KV blocks of %d tokens, instance %s)",
        config.model, host, bound, runner.cache.sizing.num_gpu_blocks, config.block_size, servicer.instance_id,
    )
    timer.add("server", timer.elapsed() - server_started)
    if (settled := settle_startup_heap("worker")) is not None:
        timer.add("heap", settled)
    if ready is not None:
        ready.set()
    heartbeats = redis = None
    if registration is not None:
        redis = redis_client.connect(registration.redis_url, max_connections=8, options=registration.redis)
        registered = Registration(WorkerRegistry(redis), registration, servicer.description)
        heartbeats = asyncio.create_task(registered.run(), name="heartbeat")
        log.info("registering in Redis as %s", registered.worker_id)

    async def announce_ready() -> None:
        # Ready once registered (a heartbeat may keep failing while Redis is away: this waits meanwhile).
        if registered is not None:
            with timer.phase("registration"):
                await registered.wait_registered()
        # SERVING now, rather than at the health watcher's next period.
        await reporter.set(await checks.evaluate())
        if reporter.state is not None and reporter.state.ready:
            report = timer.report()
            log.info("worker ready in %s", report.summary())
            if on_ready is not None:
                on_ready(report)

    announcer = asyncio.create_task(announce_ready(), name="announce-ready")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass  # not the main thread (tests run servers in threads)
    try:
        await stop.wait()
        checks.stopping = True
        await reporter.set(await checks.evaluate())  # not ready from now on, without waiting for the watcher
        if registered is not None:
            await registered.drain()
    finally:
        announcer.cancel()
        health_stop.set()
        await watcher
        if registered is not None:
            heartbeats.cancel()
            await registered.leave()
            await redis.aclose()
        await health.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        await asyncio.to_thread(model_thread.shutdown)
        if ranks is not None:
            ranks.stop()
        if metrics_server is not None:
            metrics_server.stop()
        if provider is not None:
            provider.shutdown()  # exports the spans still queued
