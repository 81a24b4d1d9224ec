"""Starts a scheduler replica: connect to Redis and the workers, run engine loops, serve Generate.

Start-up, each phase timed for the `scheduler ready in ...` line (shared/startup_timer.py):

    imports (the CLI's) ─▶ redis ─▶ tokenizer ─▶ heap ─▶ waiting for a worker ─▶ server ─▶ ready ─▶ first lease
    (serving); heap: the start-up heap frozen (shared/startup_heap.py), in `llmserve scheduler` only

The replica is ready (health SERVING) once a routable worker is registered; it serves a first request
without delay once one of its engine loops owns its worker, the `first lease` (none while every
worker's lease is another replica's).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

from protos import generation_pb2, generation_pb2_grpc, worker_pb2_grpc
from scheduler_service.admission import Admission, ModelLimits
from scheduler_service.config import SchedulerServiceConfig
from scheduler_service.engine_loop import EngineLoop
from scheduler_service.fleet import Fleet
from scheduler_service.health import SchedulerHealth
from scheduler_service.leases import Leases
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.router import Router
from scheduler_service.scheduling import max_model_len, scheduler_for
from scheduler_service.servicer import GenerationServicer
from scheduler_service.supervisor import Supervisor
from scheduler_service.store import QueueLimits, RedisStore
from shared import grpc_server, redis_client
from shared.auth import BearerTokenInterceptor
from shared.errors import StartupError, UnavailableError
from shared.health_probes import HealthReporter, watch_health
from shared.metrics import MetricsServer, SchedulerMetrics
from shared.registry_changes import RegistryChanges
from shared.secrets import redact_url
from shared.startup_heap import settle_startup_heap
from shared.startup_timer import StartupReport, StartupTimer
from shared.tls import bind, describe, open_channel
from shared.tokenizer_loading import load_tokenizer
from shared.tracing import TracingConfig, make_tracer
from shared.worker_registry import WorkerEntry, WorkerRegistry

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# How often liveness and readiness are re-evaluated (at most; a third of a short liveness timeout).
HEALTH_PERIOD_SECONDS = 1.0
# The registry is read again this often while waiting for a first worker, should its announcement be lost.
WORKER_POLL_SECONDS = 0.5
# Redis is pinged again this often while it does not answer at start-up.
REDIS_RETRY_SECONDS = 1.0
# A start-up that waits (for Redis, for a first worker) says so this often.
WAIT_NEWS_SECONDS = 30.0
# The phase of the start-up spent waiting for a worker to register (LocalCluster tells it from the replica's own work).
WAITING_FOR_A_WORKER = "waiting for a worker"


async def wait_for_redis(store: RedisStore, url: str, deadline: float) -> None:
    """Waits until Redis answers (it may start after the replicas, as a fresh deployment starts them all at once),
    saying so at the first failure and every WAIT_NEWS_SECONDS; StartupError past `deadline` (loop time)."""
    loop = asyncio.get_running_loop()
    begun, said = loop.time(), None
    while True:
        try:
            await store.ping()
            return
        except UnavailableError as exc:
            if loop.time() > deadline:
                raise StartupError(f"Redis at {redact_url(url)} did not answer within "
                                   f"{deadline - begun:.0f} s: {exc}") from None
            if said is None or loop.time() - said >= WAIT_NEWS_SECONDS:  # the first failure at once
                said = loop.time()
                log.warning("Redis at %s does not answer yet (%s); retrying for up to %.0f s more", redact_url(url),
                            exc, deadline - loop.time())
        await asyncio.sleep(REDIS_RETRY_SECONDS)


async def wait_for_workers(registry: WorkerRegistry, deadline: float, changes: RegistryChanges) -> list[WorkerEntry]:
    """Waits until at least one worker has registered and is alive (workers may still be loading models), saying so
    every WAIT_NEWS_SECONDS; StartupError past `deadline` (loop time).

    changes: wakes the wait as a worker registers, rather than at the next poll.
    """
    loop = asyncio.get_running_loop()
    begun = said = loop.time()
    while True:
        entries = [e for e in await registry.workers() if e.alive]
        if entries:
            return entries
        if loop.time() > deadline:
            raise StartupError(f"no worker registered in Redis within {deadline - begun:.0f} s; start workers with the "
                               "same --redis-url")
        if loop.time() - said >= WAIT_NEWS_SECONDS:
            said = loop.time()
            log.info("still waiting for a worker to register in Redis (%.0f s so far; a worker registers once its "
                     "model is loaded, and its first start on a machine compiles its kernels)", said - begun)
        await changes.wait(WORKER_POLL_SECONDS)


async def serve(config: SchedulerServiceConfig, host: str, port: int, startup: StartupTimer | None = None,
                on_ready: Callable[[StartupReport], None] | None = None,
                on_serving: Callable[[StartupReport], None] | None = None) -> None:
    """Runs the replica until SIGINT/SIGTERM (or cancellation).

    startup: the timer of this process's start-up (the CLI starts it before its imports). on_ready is
    called with its report once the replica is ready (health SERVING), on_serving once an engine loop
    of it first owns its worker.
    """
    timer = startup if startup is not None else StartupTimer()
    stop = asyncio.Event()
    # Redis and a first worker, within one start-up deadline (the startup probe's time, deploy/k8s).
    deadline = asyncio.get_running_loop().time() + config.worker_connect_timeout_s
    with timer.phase("redis"):
        store = RedisStore(redis_client.connect(config.redis_url, options=config.redis), config.output_retention_s)
        await wait_for_redis(store, config.redis_url, deadline)
    # Listening from the start: the wait for a first worker below wakes as it registers.
    changes = RegistryChanges(store.client)
    tasks = [asyncio.create_task(changes.run(stop), name="registry-changes")]
    try:
        with timer.phase("tokenizer"):
            tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer)
        # Loaded: before a wait for workers that may take long (shared/startup_heap.py).
        if (settled := settle_startup_heap("scheduler")) is not None:
            timer.add("heap", settled)
        registry = WorkerRegistry(store.client)
        with timer.phase(WAITING_FOR_A_WORKER):
            entries = await wait_for_workers(registry, deadline, changes)
    except BaseException:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    server_started = timer.elapsed()
    descs = [e.description for e in entries]
    max_len = max_model_len(config, min(d.max_model_len for d in descs))
    admission = Admission(tokenizer, ModelLimits(max_model_len=max_len, vocab_size=min(d.vocab_size for d in descs),
                                                 max_num_seqs=config.max_num_seqs))
    model_name = Path(descs[0].model).name or descs[0].model
    tracer, provider = make_tracer(TracingConfig.from_env("llmserve-scheduler", config.otlp_endpoint, config.trace_file))
    metrics = SchedulerMetrics(model_name) if config.metrics_port else None
    leases = Leases(store.client, replica_id=f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}",
                    ttl_s=config.lease_ttl_s)
    profiles = itertools.count()
    router = Router(store, prefix_aware=config.enable_prefix_caching, block_size=descs[0].block_size)
    router.update(entries)
    fleet = Fleet(leases, registry, router)

    loop = asyncio.get_running_loop()
    first_owner: asyncio.Future[tuple[str, int]] = loop.create_future()

    def owned(worker_id: str, epoch: int) -> None:
        """EngineLoop's on_owned: the first loop of this replica to own its worker makes the replica serve."""
        if not first_owner.done():
            first_owner.set_result((worker_id, epoch))

    def make_loop(entry: WorkerEntry) -> EngineLoop:
        if entry.description.model != descs[0].model:
            log.warning("worker %s serves %s, this replica was started for %s", entry.worker_id,
                        entry.description.model, descs[0].model)
        channel = open_channel(entry.worker_id, config.worker_tls, aio=True)
        scheduler = scheduler_for(config, entry.description)
        n = next(profiles)
        profile = Path(config.profile_steps if n == 0 else f"{config.profile_steps}.{n}") if config.profile_steps else None
        return EngineLoop(entry.worker_id, worker_pb2_grpc.WorkerStub(channel), store, scheduler,
                          OutputProcessor(tokenizer, scheduler), fleet, profile, tracer=tracer,
                          metrics=metrics.engine(entry.worker_id) if metrics is not None else None,
                          step_timeout_s=config.step_timeout_s, channel=channel, registration=entry,
                          on_owned=owned, async_scheduling=config.async_scheduling,
                          num_scheduler_steps=config.num_scheduler_steps)

    supervisor = Supervisor(registry, leases, router, make_loop, changes=changes, drives_workers=not config.front_only)
    servicer = GenerationServicer(admission, store, router, tracer, model_name,
                                  QueueLimits(config.max_num_queued_requests, config.max_queued_tokens))
    auth = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc_server.create_server(grpc_server.PUBLIC_MAX_REQUEST_BYTES, public=True, interceptors=auth)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = grpc_server.add_health_and_reflection(server, [SERVICE_NAME])
    bound = bind(server, host, port, config.tls, "scheduler")
    log.info("public API over %s, %s; workers over %s", describe(config.tls),
             "bearer token required" if config.auth_token else "no token", describe(config.worker_tls))
    if config.auth_token and config.tls is None:
        log.warning("--auth-token-file without --tls-cert-file: the token travels in clear text")
    metrics_server = MetricsServer(metrics.registry, config.metrics_port, host) if metrics is not None else None
    tasks.append(asyncio.create_task(supervisor.run(stop), name="supervisor"))
    if config.liveness_timeout_s <= config.step_timeout_s:
        log.warning("--liveness-timeout %gs is not above --step-timeout %gs: a hung worker makes this replica "
                    "unlive before the step timeout can reset it", config.liveness_timeout_s, config.step_timeout_s)
    checks = SchedulerHealth(lambda: supervisor.loops, router, store, config.liveness_timeout_s)
    reporter = HealthReporter(health, [SERVICE_NAME])
    await reporter.set(await checks.evaluate())  # before the first probe can arrive
    await server.start()
    period = min(HEALTH_PERIOD_SECONDS, config.liveness_timeout_s / 3)
    tasks.append(asyncio.create_task(watch_health(reporter, checks.evaluate, period, stop), name="health"))
    log.info("scheduler %s serving on %s:%d; %d worker(s) registered%s", leases.replica_id, host, bound, len(entries),
             "; front only: drives no worker" if config.front_only else "")
    timer.add("server", timer.elapsed() - server_started)
    if config.front_only:  # serving as soon as it is ready: it waits for no lease
        first_owner.set_result(("none (front only)", 0))
    # Not one of `tasks`, whose first to end stops the replica: this one ends once it has announced.
    announcer = asyncio.create_task(_announce(timer, reporter, first_owner, on_ready, on_serving),
                                    name="announce-ready")
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopped and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        stop.set()
        announcer.cancel()
        # Probes and the HTTP front see NOT_SERVING while the server finishes its calls; the streams still
        # running after the grace period end with UNAVAILABLE, their requests kept for their clients to resume.
        servicer.stop_owning()
        await health.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        # The supervisor stops its loops (a last commit each) and gives their leases back.
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()
        if metrics_server is not None:
            metrics_server.stop()
        if provider is not None:
            provider.shutdown()  # exports the spans still queued


async def _announce(timer: StartupTimer, reporter: HealthReporter, first_owner: asyncio.Future[tuple[str, int]],
                    on_ready: Callable[[StartupReport], None] | None,
                    on_serving: Callable[[StartupReport], None] | None) -> None:
    """Logs and reports ready, then serving (at once if a loop owned its worker before readiness was published)."""
    await reporter.wait_ready()
    report = timer.report()
    log.info("scheduler ready in %s", report.summary())
    if on_ready is not None:
        on_ready(report)
    worker_id, epoch = await first_owner
    timer.add("first lease", timer.elapsed() - report.total_s)
    report = timer.report()
    log.info("scheduler serving in %s: worker %s, epoch %d", report.summary(), worker_id, epoch)
    if on_serving is not None:
        on_serving(report)
