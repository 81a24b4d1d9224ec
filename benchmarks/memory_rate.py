"""This machine's memory read rate, timed in the same run as the results it helps read.

A decode step of a few sequences reads every weight once (the default model: 540 MB in float32), so its
time follows the rate at which the cores read memory, not their multiply-adds. On the shared 2-core
machines of docs/benchmarks-history.md that rate moved between ~40 and ~80 GB/s from one minute to the
next while the GEMM rate held, so the report gives the rate of its own run beside the numbers it moves.
"""

from __future__ import annotations

import time

import torch

# Far larger than any CPU cache (32 MiB of L3 on the machines the history names): every byte comes from memory.
READ_BYTES = 1 << 30


def memory_read_gbs(repeats: int = 5) -> float:
    """GB/s of the fastest of ``repeats`` sums over a 1 GiB float32 tensor on torch's threads (all usable cores)."""
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    data.sum()  # the pages are touched, the threads are up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return READ_BYTES / best / 1e9
