"""The float32 GEMM rate the report's throughput floor is built on, timed on this machine."""

from __future__ import annotations

import torch

from benchmarks._timing import time_ms
from worker_service.models.linear import Linear


def gemm_rate_gflops(repeats: int = 100) -> float:
    """float32 GFLOP/s of the fastest GEMM this machine runs on one of the model's shapes ([512, 576] x [576, 1536]).

    Both torch.mm (MKL) and the worker's projection (oneDNN on a packed weight,
    worker_service/models/linear.py) are timed and the faster one counts, so the report's
    floor is what the best matmul here could do, not what the worker happens to use.
    """
    cpu = torch.device("cpu")

    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    projection = Linear(b.T.contiguous())
    fastest_ms = min(time_ms(lambda: torch.mm(a, b), cpu, repeats=repeats),
                     time_ms(lambda: projection(a), cpu, repeats=repeats))
    return 2 * 512 * 576 * 1536 / (fastest_ms / 1e3) / 1e9
