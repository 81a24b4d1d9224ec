"""A float32 ``exp`` and ``log`` that Numba loops can vectorize.

Without Intel's SVML (not installed with Numba's wheels) LLVM turns ``math.exp`` in a
loop into one libm call per element: measured 3x slower than this polynomial, which
compiles to eight-lane AVX2 arithmetic. Prefill attention takes one exp per score, a
tenth of its multiply-adds, so a scalar exp would cost about a third of the kernel.

The method is Cephes' ``expf``: ``exp(v) = 2^n * exp(r)`` with ``n = round(v / ln 2)``,
``r = v - n ln 2`` in ``[-ln2 / 2, ln2 / 2]`` (``ln 2`` split in two constants so
that ``n ln 2`` is exact), a degree-7 polynomial for ``exp(r)`` (about 1 ulp), and
``2^n`` built directly from its exponent bits.

``log`` is Cephes' ``logf``: ``x = m * 2^e`` with ``m`` in ``[sqrt(1/2), sqrt(2))`` read off
the bits, ``log(m)`` by a degree-9 polynomial in ``m - 1`` (about 1 ulp), plus ``e ln 2``
(again in two parts).
"""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_llvm import bits_from_float, float_from_bits
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

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


@numba.njit(inline="always", fastmath={"contract"}, cache=True)
def log_f32(x: np.float32) -> np.float32:
    """``log(x)`` for a normal, positive, finite float32 ``x`` (the caller's guarantee: no branch for the rest)."""
    bits = bits_from_float(x)
    e = np.float32((bits >> np.int32(23)) - np.int32(126))
    m = float_from_bits((bits & np.int32(0x007FFFFF)) | np.int32(0x3F000000))  # x = m * 2^e, m in [1/2, 1)
    low = m < np.float32(0.707106781186547524)
    e = e - np.float32(1.0) if low else e
    r = (m + m if low else m) - np.float32(1.0)
    z = r * r
    y = np.float32(7.0376836292e-2)
    y = y * r - np.float32(1.1514610310e-1)
    y = y * r + np.float32(1.1676998740e-1)
    y = y * r - np.float32(1.2420140846e-1)
    y = y * r + np.float32(1.4249322787e-1)
    y = y * r - np.float32(1.6668057665e-1)
    y = y * r + np.float32(2.0000714765e-1)
    y = y * r - np.float32(2.4999993993e-1)
    y = y * r + np.float32(3.3333331174e-1)
    y = y * r * z
    y = y + np.float32(-2.12194440e-4) * e
    y = y - np.float32(0.5) * z
    return r + y + np.float32(0.693359375) * e
