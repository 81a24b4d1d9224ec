"""Timing helpers that work the same on a GPU (CUDA events) and a CPU (wall clock)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls (compiles, caches, allocator)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbs(device: torch.device, megabytes: int) -> float:
    """Measured bandwidth of a same-device tensor copy (bytes read + written per second, in GB/s)."""
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (ms * 1e-3) / 1e9
