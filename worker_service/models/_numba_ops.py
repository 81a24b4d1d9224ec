"""Numba kernels for the elementwise work between a decoder layer's matmuls (float32, CPU).

Each kernel is one pass over its rows where torch runs several ops (an RMSNorm is
seven: add, pow, mean, add, rsqrt, mul, mul), each with its own dispatch, output
allocation and OpenMP region. Every kernel comes twice, around the same per-row
body: serial, for decode-sized inputs where waking a thread team costs more than
the work, and parallel over rows (``prange``) for prefills. Signatures are
explicit and ``cache=True``, so a worker loads them from ``__pycache__`` instead
of compiling (each variant is a function of its own: Numba's cache is keyed by
function, not by compile flags).

Rounding follows transformers' modules where it can without giving up speed: the
rotary embedding uses the same operations in the same order (no fused
multiply-adds), so it matches bit for bit; SiLU's exp is a polynomial within an
ulp of torch's; the RMSNorm's sum of squares is accumulated in float64 (torch
sums float32 in another order; neither order is "the" answer, and float64 is
closer to the exact mean).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from llmserve.kernels.cpu._numba_llvm import float_from_bits
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

_F32_2D = numba.float32[:, ::1]
_F32_1D = numba.float32[::1]
# Elements per call above which a Numba kernel runs over rows on several threads. Below it, waking
# the thread team costs more than the pass (an RMSNorm of [64, 576] floats is ~10 us on one thread).
# With the worker's threads spinning briefly between parallel regions (shared/omp.py), SiLU-and-mul
# of a 64-sequence decode step ([64, 1536], ~100 us on one thread) gains from two: 2**16 against 2**18
# took the default model's step from 83.4 to 81.4 ms (three runs each, benchmarks/worker_step.py).
PARALLEL_MIN_ELEMENTS = 1 << 16
# No fastmath: contraction into FMAs would round differently from transformers' separate ops.
_JIT = dict(cache=True, nogil=True)


@numba.njit(fastmath={"reassoc"}, cache=True)
def _sum_of_squares(row: np.ndarray) -> float:
    """float64 sum of a float32 row's squares; reassociated (only here) so that it vectorizes."""
    total = 0.0
    for i in range(row.shape[0]):
        value = np.float64(row[i])
        total += value * value
    return total


@numba.njit(inline="always")
def _rms_norm_row(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray, t: int) -> None:
    width = x.shape[1]
    total = _sum_of_squares(x[t])
    inverse = np.float32(1.0) / np.float32(math.sqrt(np.float32(total / width) + eps))
    for i in range(width):
        out[t, i] = weight[i] * (x[t, i] * inverse)


@numba.njit(inline="always")
def _add_rms_norm_row(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray,
                      t: int) -> None:
    for i in range(x.shape[1]):
        residual[t, i] += x[t, i]
    _rms_norm_row(residual, weight, eps, out, t)


@numba.njit(inline="always")
def _rotary_row(qkv: np.ndarray, heads: int, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, t: int) -> None:
    half = qkv.shape[2] // 2
    p = positions[t]
    cos_row, sin_row = cos[p], sin[p]
    for h in range(heads):
        x = qkv[t, h]
        for i in range(half):
            c, s = cos_row[i], sin_row[i]
            x1, x2 = x[i], x[half + i]
            x[i] = x1 * c - x2 * s
            x[half + i] = x2 * c + x1 * s


@numba.njit(inline="always")
def _exp_parts(x: np.float32) -> tuple[np.float32, np.int32]:
    """e^x as (m, k) with e^x = m * 2^k: Cephes' expf, ~1 ulp, in operations that vectorize.

    k = round(x / ln 2), r = x - k ln 2 (in two parts, exactly), m = e^r by a degree-7
    polynomial on [-ln 2 / 2, ln 2 / 2]. libm's exp is a call per element that stops the
    loop from vectorizing: SiLU over [64, 1536] took twice as long with it.
    """
    x = min(max(x, np.float32(-87.33654)), np.float32(88.72283))
    k = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - k * np.float32(0.693359375)
    r = r - k * np.float32(-2.12194440e-4)
    m = np.float32(1.9875691500e-4)
    m = m * r + np.float32(1.3981999507e-3)
    m = m * r + np.float32(8.3333519073e-3)
    m = m * r + np.float32(4.1665795894e-2)
    m = m * r + np.float32(1.6666665459e-1)
    m = m * r + np.float32(5.0000001201e-1)
    m = m * r * r + r + np.float32(1.0)
    return m, np.int32(k)


@numba.njit(inline="always")
def _silu_and_mul_row(gate_up: np.ndarray, out: np.ndarray, t: int) -> None:
    width = out.shape[1]
    for i in range(width):
        gate = gate_up[t, i]
        m, k = _exp_parts(-gate)
        # 2^k from a float32's bits: the biased exponent in bits 23..30 (k >= -126 after the clamp).
        scale = float_from_bits((k + np.int32(127)) << np.int32(23))
        out[t, i] = gate / (np.float32(1.0) + m * scale) * gate_up[t, width + i]


_RMS_NORM = numba.void(_F32_2D, _F32_1D, numba.float32, _F32_2D)
_ADD_RMS_NORM = numba.void(_F32_2D, _F32_2D, _F32_1D, numba.float32, _F32_2D)
# The fused QKV projection's output as [T, heads, D], of which q's and k's heads (the first ones) are rotated: a
# contiguous array rather than a strided view of those heads, so that the loops over a head's dims vectorize
# (64 rows of the default model's 12 heads: 26.3 -> 5.0 us on one thread, the same output to the bit).
_ROTARY = numba.void(numba.float32[:, :, ::1], numba.int64, numba.int64[::1], _F32_2D, _F32_2D)
_SILU_AND_MUL = numba.void(_F32_2D, _F32_2D)


@numba.njit([_RMS_NORM], **_JIT)
def rms_norm_serial(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    """out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)); ``out`` may be ``x``."""
    for t in range(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


@numba.njit([_RMS_NORM], parallel=True, **_JIT)
def rms_norm_parallel(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    for t in numba.prange(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


@numba.njit([_ADD_RMS_NORM], **_JIT)
def add_rms_norm_serial(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: np.float32,
                        out: np.ndarray) -> None:
    """residual[t] += x[t]; out[t] = rms_norm(residual[t]). ``out`` may be ``x`` (each row is read first)."""
    for t in range(x.shape[0]):
        _add_rms_norm_row(x, residual, weight, eps, out, t)


@numba.njit([_ADD_RMS_NORM], parallel=True, **_JIT)
def add_rms_norm_parallel(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: np.float32,
                          out: np.ndarray) -> None:
    for t in numba.prange(x.shape[0]):
        _add_rms_norm_row(x, residual, weight, eps, out, t)


@numba.njit([_ROTARY], **_JIT)
def rotary_serial(qkv: np.ndarray, heads: int, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotates the first ``heads`` heads of ``qkv`` ``[T, H, D]`` in place, halves paired (GPT-NeoX / HF Llama layout).

        head = [ x1 (D/2) | x2 (D/2) ]  ->  [ x1*cos - x2*sin | x2*cos + x1*sin ]

    cos/sin: ``[max_positions, D/2]``, the cached table's row for each token's position.
    """
    for t in range(qkv.shape[0]):
        _rotary_row(qkv, heads, positions, cos, sin, t)


@numba.njit([_ROTARY], parallel=True, **_JIT)
def rotary_parallel(qkv: np.ndarray, heads: int, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    for t in numba.prange(qkv.shape[0]):
        _rotary_row(qkv, heads, positions, cos, sin, t)


# SiLU's exp is Cephes' polynomial, not torch's (Sleef): they differ by an ulp, so contraction costs nothing more.
# NumPy's error model: under Python's, every division checks its divisor for zero (to raise ZeroDivisionError),
# and that branch kept the serial kernel's loop scalar; a parallel loop's body gets NumPy's model anyway. The
# divisor here, 1 + e^-x, is at least 1. Measured (one thread, alternating in one process, the same output to
# the bit): 16 rows of 1536 19.5 -> 4.3 us serial, 256 rows 84.4 -> 66.5 us parallel (one loop, no scratch).
_SILU_JIT = dict(_JIT, fastmath={"contract"}, error_model="numpy")


@numba.njit([_SILU_AND_MUL], **_SILU_JIT)
def silu_and_mul_serial(gate_up: np.ndarray, out: np.ndarray) -> None:
    """out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i], I = out's width (gate features first, then up)."""
    for t in range(out.shape[0]):
        _silu_and_mul_row(gate_up, out, t)


@numba.njit([_SILU_AND_MUL], parallel=True, **_SILU_JIT)
def silu_and_mul_parallel(gate_up: np.ndarray, out: np.ndarray) -> None:
    for t in numba.prange(out.shape[0]):
        _silu_and_mul_row(gate_up, out, t)
