"""A Numba matmul for the few-row steps of decoding: ``out = x @ w^T (+ bias)`` with ``x`` ``[M, K]``, M small.

A decode step multiplies a handful of token rows by every weight matrix: the time is
reading the weights, once per step (135M float32 parameters are 540 MB). MKL's sgemm
on these shapes reads them at a fraction of the memory bandwidth (measured on the
2-core x86_64 machine of docs/benchmarks.md, M = 4: 2.7 GB/s against this kernel's
5.0 GB/s, in the same run), so few-row products take this kernel: threads split the
weight's rows, and each row is read once and dotted with every token row while it
sits in L1. The dot products are vectorized reductions (reassociated float32 sums,
as any BLAS does).
"""

from __future__ import annotations

import numba
import numpy as np

# Weight rows per parallel work item: enough to amortise scheduling, few enough to balance two threads.
_ROWS_PER_ITEM = 16
_F32_2D = numba.float32[:, ::1]


@numba.njit([numba.void(_F32_2D, _F32_2D, numba.float32[::1], _F32_2D)], parallel=True,
            fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def skinny_linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n] when bias is not empty)."""
    rows, inner = x.shape
    features = weight.shape[0]
    has_bias = bias.shape[0] > 0
    for item in numba.prange((features + _ROWS_PER_ITEM - 1) // _ROWS_PER_ITEM):
        for n in range(item * _ROWS_PER_ITEM, min(features, (item + 1) * _ROWS_PER_ITEM)):
            for m in range(rows):
                total = np.float32(0.0)
                for k in range(inner):
                    total += x[m, k] * weight[n, k]
                out[m, n] = total + bias[n] if has_bias else total
