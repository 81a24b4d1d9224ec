"""Sends a workload's requests the way every benchmark client does: all at once or Poisson arrivals, capped.

Requests arrive all at once (rate = inf) or as a Poisson process of the given rate, optionally with
at most `max_concurrency` in flight; the driver's coroutine for one request does the rest.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from tqdm import tqdm

from benchmarks.dataset import BenchRequest
from benchmarks.metrics import RequestTiming


async def send_all(requests: list[BenchRequest], one: Callable[[BenchRequest], Awaitable[RequestTiming]],
                   rate: float, max_concurrency: int | None, seed: int, label: str
                   ) -> tuple[list[RequestTiming], float]:
    """Per-request timings (in request order) and the wall time from the first request sent to the last finished."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    with tqdm(total=len(requests), desc=label, unit="req", leave=False) as bar:
        async def run(req: BenchRequest) -> RequestTiming:
            if limit is None:
                timing = await one(req)
            else:
                async with limit:
                    timing = await one(req)
            bar.update(1)
            return timing

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(run(req)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
        return list(timings), time.perf_counter() - start
