"""The float32 GEMM rate the report's throughput floor is built on, timed on this machine."""

from __future__ import annotations

import torch

from benchmarks._timing import time_ms
from worker_service.models.linear import Linear


def gemm_rate_gflops(repeats: int = 100) -> float:
    """float32 GFLOP/s of the fastest GEMM this machine runs on one of the model's shapes ([512, 576] x [576, 1536]).

    torch.mm (MKL) and both of the worker's float32 projection kernels (oneDNN on a packed weight,
    and the Numba panel tiles; worker_service/models/linear.py) are timed and the fastest one
    counts, so the report's floor is what the best matmul here could do, not what the worker
    happens to use. (The panel tiles spill on CPUs without AVX-512: there they only lose.)
    """
    cpu = torch.device("cpu")

    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    onednn, panels = Linear(b.T.contiguous()), Linear(b.T.contiguous(), panels=True)
    fastest_ms = min(time_ms(fn, cpu, repeats=repeats)
                     for fn in (lambda: torch.mm(a, b), lambda: onednn(a), lambda: panels(a)))
    return 2 * 512 * 576 * 1536 / (fastest_ms / 1e3) / 1e9
