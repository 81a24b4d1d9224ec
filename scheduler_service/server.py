"""Starts a scheduler replica: connect to Redis and the workers, run engine loops, serve Generate."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from protos import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_service.admission import Admission, ModelLimits
from scheduler_service.config import SchedulerServiceConfig
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine_loop import EngineLoop
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.router import Router
from scheduler_service.servicer import GenerationServicer
from scheduler_service.store import QueueLimits, RedisStore
from shared import grpc_server
from shared.checkpoint import pretrained_source
from shared.metrics import MetricsServer, SchedulerMetrics
from shared.tracing import TracingConfig, make_tracer

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def describe_worker(stub: worker_pb2_grpc.WorkerStub, address: str, timeout_s: float) -> worker_pb2.WorkerDescription:
    """Waits for a worker to come up (it may still be loading its model) and describes it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await stub.Describe(worker_pb2.DescribeRequest(), timeout=10, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            if loop.time() > deadline:
                raise RuntimeError(f"worker {address} did not answer within {timeout_s}s: {exc.details()}") from exc
            await asyncio.sleep(0.5)


def _scheduler_for(config: SchedulerServiceConfig, desc: worker_pb2.WorkerDescription) -> Scheduler:
    max_len = min(config.max_model_len or desc.max_model_len, desc.max_model_len)
    # vLLM's defaults: without chunking a whole prompt must fit one step; with it, small steps keep decodes flowing.
    default_budget = 512 if config.enable_chunked_prefill else max(max_len, 2048)
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens or default_budget,
            max_model_len=max_len, enable_chunked_prefill=config.enable_chunked_prefill,
        ),
        CacheConfig(
            block_size=desc.block_size, num_gpu_blocks=desc.num_gpu_blocks, num_cpu_blocks=desc.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching, sliding_window=desc.sliding_window or None,
        ),
    )


async def serve(config: SchedulerServiceConfig, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Runs the replica until SIGINT/SIGTERM (or cancellation)."""
    store = RedisStore.from_url(config.redis_url)
    await store.ping()
    source, kwargs = pretrained_source(config.tokenizer)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, source, **kwargs)
    channels = [grpc.aio.insecure_channel(a, options=grpc_server.CHANNEL_OPTIONS) for a in config.workers]
    stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
    descs = [await describe_worker(s, a, config.worker_connect_timeout_s) for s, a in zip(stubs, config.workers)]
    worker_max_len = min(d.max_model_len for d in descs)
    max_len = min(config.max_model_len or worker_max_len, worker_max_len)
    admission = Admission(tokenizer, ModelLimits(max_model_len=max_len, vocab_size=min(d.vocab_size for d in descs),
                                                 max_num_seqs=config.max_num_seqs))
    model_name = Path(descs[0].model).name or descs[0].model
    tracer, provider = make_tracer(TracingConfig.from_env("llmserve-scheduler", config.otlp_endpoint, config.trace_file))
    metrics = SchedulerMetrics(model_name) if config.metrics_port else None

    stop = asyncio.Event()
    loops = []
    for address, stub, desc in zip(config.workers, stubs, descs):
        scheduler = _scheduler_for(config, desc)
        profile = Path(f"{config.profile_steps}.{len(loops)}") if len(config.workers) > 1 else Path(config.profile_steps)
        loops.append(EngineLoop(address, stub, store, scheduler, OutputProcessor(tokenizer, scheduler),
                                profile if config.profile_steps else None, tracer=tracer,
                                metrics=metrics.engine(address) if metrics is not None else None,
                                step_timeout_s=config.step_timeout_s))
    limits = QueueLimits(config.max_num_queued_requests, config.max_queued_tokens)
    servicer = GenerationServicer(admission, store, Router(config.workers), tracer=tracer, model_name=model_name,
                                  queue_limits=limits)
    server = grpc_server.create_server(grpc_server.PUBLIC_MAX_REQUEST_BYTES, public=True)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = grpc_server.add_health_and_reflection(server, [SERVICE_NAME])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"scheduler could not bind {host}:{port}")
    metrics_server = MetricsServer(metrics.registry, config.metrics_port, host) if metrics is not None else None
    tasks = [asyncio.create_task(loop.run(stop), name=f"engine-{loop.worker_id}") for loop in loops]
    await server.start()
    await grpc_server.mark_serving(health, [SERVICE_NAME])
    log.info("scheduler serving on %s:%d, driving %d worker(s)", host, bound, len(loops))
    if ready is not None:
        ready.set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    stopped = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopped and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        stop.set()
        await server.stop(grace=2.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()
        await store.close()
        if metrics_server is not None:
            metrics_server.stop()
        if provider is not None:
            provider.shutdown()  # exports the spans still queued
