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
rotary embedding and SiLU use the same operations in the same order (no fused
multiply-adds), so they match bit for bit; the RMSNorm's sum of squares is
accumulated in float64 (torch sums float32 in another order; neither order is
"the" answer, and float64 is closer to the exact mean).
"""

from __future__ import annotations

import math

import numba
import numpy as np

_F32_2D = numba.float32[:, ::1]
_F32_1D = numba.float32[::1]
# No fastmath: contraction into FMAs would round differently from transformers' separate ops.
_JIT = dict(cache=True, nogil=True)


@numba.njit(inline="always")
def _rms_norm_row(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray, t: int) -> None:
    width = x.shape[1]
    total = 0.0
    for i in range(width):
        value = np.float64(x[t, i])
        total += value * value
    inverse = np.float32(1.0) / np.float32(math.sqrt(np.float32(total / width) + eps))
    for i in range(width):
        out[t, i] = weight[i] * (x[t, i] * inverse)


@numba.njit(inline="always")
def _add_rms_norm_row(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray,
                      t: int) -> None:
    width = x.shape[1]
    total = 0.0
    for i in range(width):
        value = residual[t, i] + x[t, i]
        residual[t, i] = value
        wide = np.float64(value)
        total += wide * wide
    inverse = np.float32(1.0) / np.float32(math.sqrt(np.float32(total / width) + eps))
    for i in range(width):
        out[t, i] = weight[i] * (residual[t, i] * inverse)


@numba.njit(inline="always")
def _rotary_row(qk: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, t: int) -> None:
    heads, dim = qk.shape[1], qk.shape[2]
    half = dim // 2
    p = positions[t]
    for h in range(heads):
        for i in range(half):
            c, s = cos[p, i], sin[p, i]
            x1, x2 = qk[t, h, i], qk[t, h, half + i]
            qk[t, h, i] = x1 * c - x2 * s
            qk[t, h, half + i] = x2 * c + x1 * s


@numba.njit(inline="always")
def _silu_and_mul_row(gate_up: np.ndarray, out: np.ndarray, t: int) -> None:
    width = out.shape[1]
    for i in range(width):
        gate = gate_up[t, i]
        out[t, i] = gate / (np.float32(1.0) + np.float32(math.exp(-gate))) * gate_up[t, width + i]


_RMS_NORM = numba.void(_F32_2D, _F32_1D, numba.float32, _F32_2D)
_ADD_RMS_NORM = numba.void(_F32_2D, _F32_2D, _F32_1D, numba.float32, _F32_2D)
# q and k are a strided view of the fused QKV projection's output: any layout.
_ROTARY = numba.void(numba.float32[:, :, :], numba.int64[::1], _F32_2D, _F32_2D)
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
def rotary_serial(qk: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotates every head of ``qk`` ``[T, heads, D]`` in place, halves paired (GPT-NeoX / HF Llama layout).

        head = [ x1 (D/2) | x2 (D/2) ]  ->  [ x1*cos - x2*sin | x2*cos + x1*sin ]

    cos/sin: ``[max_positions, D/2]``, the cached table's row for each token's position.
    """
    for t in range(qk.shape[0]):
        _rotary_row(qk, positions, cos, sin, t)


@numba.njit([_ROTARY], parallel=True, **_JIT)
def rotary_parallel(qk: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    for t in numba.prange(qk.shape[0]):
        _rotary_row(qk, positions, cos, sin, t)


@numba.njit([_SILU_AND_MUL], **_JIT)
def silu_and_mul_serial(gate_up: np.ndarray, out: np.ndarray) -> None:
    """out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i], I = out's width (gate features first, then up)."""
    for t in range(out.shape[0]):
        _silu_and_mul_row(gate_up, out, t)


@numba.njit([_SILU_AND_MUL], parallel=True, **_JIT)
def silu_and_mul_parallel(gate_up: np.ndarray, out: np.ndarray) -> None:
    for t in numba.prange(out.shape[0]):
        _silu_and_mul_row(gate_up, out, t)
