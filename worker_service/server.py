"""Starts a worker: load the model, size the cache, serve the Worker API."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import torch

from protos import worker_pb2, worker_pb2_grpc
from shared import grpc_server
from shared.metrics import MetricsServer, WorkerMetrics
from shared.tracing import TracingConfig, make_tracer
from worker_service.config import WorkerConfig
from worker_service.model_runner import ModelRunner
from worker_service.servicer import WorkerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


async def serve(config: WorkerConfig, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Runs the worker until SIGINT/SIGTERM (or cancellation)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    runner = await asyncio.to_thread(ModelRunner, config)
    tracer, provider = make_tracer(TracingConfig.from_env("llmserve-worker", config.otlp_endpoint, config.trace_file))
    metrics = WorkerMetrics(Path(config.model).name or config.model) if config.metrics_port else None
    servicer = WorkerServicer(runner, model_name=config.model, tracer=tracer, metrics=metrics)
    server = grpc_server.create_server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = grpc_server.add_health_and_reflection(server, [SERVICE_NAME])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"worker could not bind {host}:{port}")
    metrics_server = MetricsServer(metrics.registry, config.metrics_port, host) if metrics is not None else None
    await server.start()
    await grpc_server.mark_serving(health, [SERVICE_NAME])
    log.info(
        "worker serving %s on %s:%d (%d KV blocks of %d tokens, instance %s)",
        config.model, host, bound, runner.cache.sizing.num_gpu_blocks, config.block_size, servicer.instance_id,
    )
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass  # not the main thread (tests run servers in threads)
    try:
        await stop.wait()
    finally:
        await server.stop(grace=2.0)
        if metrics_server is not None:
            metrics_server.stop()
        if provider is not None:
            provider.shutdown()  # exports the spans still queued
