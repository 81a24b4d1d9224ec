"""Drives a llmserve scheduler through gRPC `Generate`, as a crowd of streaming clients.

Arrivals as in benchmarks.arrivals; every output token is timestamped when its
message arrives.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from benchmarks.arrivals import send_all
from benchmarks.dataset import BenchRequest
from benchmarks.metrics import RequestTiming
from llmserve.client import make_request
from protos import generation_pb2_grpc
from shared.auth import token_interceptors
from shared.tls import ClientTLS, open_channel


@dataclass(frozen=True)
class Target:
    """The scheduler to drive: its address, the TLS to reach it with and the bearer token it wants."""

    address: str
    tls: ClientTLS | None = None
    token: str = field(default="", repr=False)


async def _one(stub: generation_pb2_grpc.GenerationStub, req: BenchRequest) -> RequestTiming:
    timing = RequestTiming(prompt_len=len(req.prompt_token_ids), sent=time.perf_counter())
    request = make_request(prompt_token_ids=req.prompt_token_ids, max_tokens=req.output_len, temperature=0.0,
                           ignore_eos=True)
    try:
        async for msg in stub.Generate(request, timeout=3600):
            now = time.perf_counter()
            for delta in msg.outputs:
                timing.token_times.extend([now] * len(delta.token_ids))
            if msg.error:
                timing.error = msg.error
    except grpc.aio.AioRpcError as exc:
        timing.error = f"{exc.code().name}: {exc.details()}"
    timing.done = time.perf_counter()
    return timing


async def _run(target: Target, requests: list[BenchRequest], rate: float, max_concurrency: int | None,
               seed: int, label: str) -> tuple[list[RequestTiming], float]:
    channel = open_channel(target.address, target.tls, aio=True, interceptors=token_interceptors(target.token, aio=True))
    async with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await channel.channel_ready()
        return await send_all(requests, lambda req: _one(stub, req), rate, max_concurrency, seed, label)


def run_llmserve(address: str | Target, requests: list[BenchRequest], rate: float = float("inf"),
                 max_concurrency: int | None = None, seed: int = 0, label: str = "llmserve"
                 ) -> tuple[list[RequestTiming], float]:
    """Per-request timings and the wall time from the first request sent to the last finished."""
    target = address if isinstance(address, Target) else Target(address)
    return asyncio.run(_run(target, requests, rate, max_concurrency, seed, label))
