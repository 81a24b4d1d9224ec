"""The one thread that runs a worker's torch work: kernel loading, model loading and every step.

libgomp (torch's OpenMP runtime) gives each thread that opens a parallel region a thread team of
its own, and its idle threads spin before they sleep only while the process's OpenMP threads, all
teams together, do not outnumber the cores (shared/omp.py). A worker that loaded its model on one
thread and ran steps on others (asyncio.to_thread) held two teams: on 2 cores, that turned every
wait into a sleep, and each of a decode step's ~120 parallel regions paid for waking a thread.
With load and steps on one thread (and a short spin), one step of the default model at one sequence
took 18.4 ms instead of 23.1 (benchmarks/worker_step.py, alternating runs: docs/benchmarks-history.md).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ModelThread:
    """An executor of one thread; `call` runs a function there from asyncio code, as asyncio.to_thread does."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-model")

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        # The caller's context variables travel with the call (the tracing context among them).
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, context.run, fn, *args)

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs fn on the thread and waits for it, from code outside an event loop."""
        return self._executor.submit(fn, *args).result()

    def shutdown(self) -> None:
        """Waits for the running call, if any, and ends the thread."""
        self._executor.shutdown(wait=True)
