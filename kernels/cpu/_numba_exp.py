"""A float32 ``exp`` that Numba loops can vectorize.

Without Intel's SVML (not installed with Numba's wheels) LLVM turns ``math.exp`` in a
loop into one libm call per element: measured 3x slower than this polynomial, which
compiles to eight-lane AVX2 arithmetic. Prefill attention takes one exp per score, a
tenth of its multiply-adds, so a scalar exp would cost about a third of the kernel.

The method is Cephes' ``expf``: ``exp(v) = 2^n * exp(r)`` with ``n = round(v / ln 2)``,
``r = v - n ln 2`` in ``[-ln2 / 2, ln2 / 2]`` (``ln 2`` split in two constants so
that ``n ln 2`` is exact), a degree-7 polynomial for ``exp(r)`` (about 1 ulp), and
``2^n`` built directly from its exponent bits.
"""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_llvm import float_from_bits

# Below this exp underflows float32's normal range; the result is 0 (exactly, for -inf:
# masked scores must weigh nothing).
_LOWEST = np.float32(-87.0)


@numba.njit(inline="always", fastmath={"contract"}, cache=True)
def exp_f32(v: np.float32) -> np.float32:
    """``exp(v)`` for ``v <= 88`` (scores minus their maximum are <= 0); 0 below -87, and for -inf."""
    c = max(v, _LOWEST)
    n = np.floor(c * np.float32(1.4426950408889634) + np.float32(0.5))
    r = c - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    power = float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # 2^n
    return p * power if v >= _LOWEST else np.float32(0.0)
