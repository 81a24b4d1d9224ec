"""A decode step through every decoder layer in one compiled call (CPU): no Python between the kernels.

The layer-by-layer path makes ~20 Python-level calls per layer (Numba, oneDNN and torch
dispatches, tensor views): ~0.2 ms a layer, milliseconds a step. Here the layer loop runs in
Numba, calling the same norm, rotary, cache-write and decode-attention kernels, with one of two
projections:

- ``decode_layers``: a few rows (float32 or bf16), each projection a GEMV over the dense weight
  (``gemv``: every weight row read once from memory, at the memory's bandwidth, for all rows);
- ``decode_layers_panels``: any row count (float32), each projection the panel kernel over the
  weights the layer-by-layer path multiplies (models/_numba_panels.py), bit for bit its results.

Weights are stacked per kind over the layers (``[L, out, in]`` dense, ``[L, N * K]`` panels), biases
``[L, out]`` or ``[L, 0]`` for none; the caches come stacked over the layers too (one allocation, see
``kernels.layout.stacked_layers``): a Numba typed list of the per-layer arrays compiled its
methods in every worker process, ~0.4 s per list type at the first compiled step.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

from llmserve.kernels.cpu._numba_bf16 import widen
from llmserve.kernels.cpu._numba_decode import BF16_SIGNATURES as ATTENTION_BF16
from llmserve.kernels.cpu._numba_decode import decode_attention
from llmserve.kernels.cpu._numba_llvm import prefetch
from llmserve.kernels.cpu._numba_variants import require
from llmserve.kernels.cpu.host_cpu import is_amd_avx512
from llmserve.kernels.cpu.numba_cache_ops import PARALLEL_MIN_TOKENS, write_parallel, write_token
from llmserve.kernels.numba_cache import versioned_cache
from worker_service.models._numba_ops import (
    PARALLEL_MIN_ELEMENTS, add_rms_norm_parallel, add_rms_norm_serial, rms_norm_serial, rotary_parallel, rotary_serial,
    silu_and_mul_parallel, silu_and_mul_serial,
)
from worker_service.models._numba_panels import panel_matmul

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

# Explicit signatures: importing this module compiles the functions, or loads them from Numba's cache
# (cache=True), at the worker's start rather than in its first compiled step. Weights, the embedding and the
# caches are float32, or bf16 viewed as int16 (widened as they are read; activations stay float32); the bf16
# form of the layers (and of the decode attention it calls) is compiled by `require_bf16`, when a bf16 worker
# loads its model (kernels/cpu/_numba_variants.py).
_F32_1D, _F32_2D = numba.float32[::1], numba.float32[:, ::1]
_I64_1D = numba.int64[::1]
_ELEMENTS = (numba.float32, numba.int16)
_GEMVS = [numba.void(_F32_2D, element[:, ::1], _F32_1D, _F32_2D) for element in _ELEMENTS]
_FLOAT32_LAYERS, _BF16_LAYERS = (
    [numba.void(
        _I64_1D, _I64_1D, element[:, ::1],  # input_ids, positions, embed
        _F32_2D, _F32_2D, _F32_1D,  # input_norms, post_norms, final_norm
        *(element[:, :, ::1], _F32_2D) * 4,  # weights and biases of qkv, o, gate_up, down
        _I64_1D, _F32_2D, _F32_2D,  # windows, cos, sin
        element[:, :, :, :, :, ::1], element[:, :, :, :, ::1],  # key and value caches, all layers
        _I64_1D, numba.int32[:, ::1], numba.int32[::1],  # slots, block_tables, context_lens
        numba.int64, numba.int64, numba.float32, numba.float32, numba.int64,  # heads, kv heads, eps, scale, threads
        _F32_2D,  # out
    )]
    for element in _ELEMENTS
)
# The panel step's arguments: float32 only, each projection's panels flat per layer ([L, N * K]).
_PANEL_LAYERS = [
    numba.void(
        _I64_1D, _I64_1D, _F32_2D, _F32_2D, _F32_2D, _F32_1D, *(_F32_2D, _F32_2D) * 4, _I64_1D, _F32_2D, _F32_2D,
        numba.float32[:, :, :, :, :, ::1], numba.float32[:, :, :, :, ::1], _I64_1D, numba.int32[:, ::1],
        numba.int32[::1], numba.int64, numba.int64, numba.float32, numba.float32, numba.int64, numba.int64, _F32_2D,
    )
]
# Weight rows asked for ahead of the one being read. The hardware prefetcher alone kept the default model's
# layer GEMVs (one row, weights out of cache) at 18-22 GB/s in float32 and 12-15 GB/s in bf16 on the Xeon of
# docs/benchmarks-history.md; two rows ahead, 25-27 and 21-22 GB/s (four and eight ahead: no better). On a
# Zen 4 the same prefetches cost more than they bring: 22-24 GB/s against 31-38 without (same history), so
# AMD's AVX-512 cores leave it to the hardware. (A global: compiled in as a constant, cached per host CPU.)
_ROWS_AHEAD = 0 if is_amd_avx512() else 2
_LINE_BYTES = 64


@numba.njit(_GEMVS, parallel=True, fastmath={"contract", "reassoc"}, cache=True, nogil=True)
def gemv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """``out[r] = weight @ x[r] (+ bias)`` for the few rows of ``x``; threads split the weight's rows.

    Each weight row is read from memory once (its cache lines asked for two rows ahead) and, loaded
    into registers, serves four rows of ``x`` at a time (then two, then one). The default model's
    layer projections on the Zen 1 EPYC of docs/benchmarks-history.md, one dot product per row (the
    weight row reloaded from L1) against this: 26.6 / 32.2 / 37.0 ms against 22.9 / 27.9 / 26.3 ms at two / three / four
    rows, the same 20-21 ms at one.
    """
    rows, width = x.shape
    has_bias = bias.shape[0] > 0
    outputs = weight.shape[0]
    per_line = _LINE_BYTES // weight.itemsize
    for o in numba.prange(outputs):
        if _ROWS_AHEAD and o + _ROWS_AHEAD < outputs:
            ahead = weight[o + _ROWS_AHEAD]
            for i in range(0, width, per_line):
                prefetch(ahead, i)
        w = weight[o]
        b = bias[o] if has_bias else np.float32(0.0)
        r = 0
        while r + 4 <= rows:
            x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for i in range(width):
                wi = widen(w[i])
                a0 += x0[i] * wi
                a1 += x1[i] * wi
                a2 += x2[i] * wi
                a3 += x3[i] * wi
            out[r, o], out[r + 1, o], out[r + 2, o], out[r + 3, o] = a0 + b, a1 + b, a2 + b, a3 + b
            r += 4
        if r + 2 <= rows:
            x0, x1 = x[r], x[r + 1]
            a0 = a1 = np.float32(0.0)
            for i in range(width):
                wi = widen(w[i])
                a0 += x0[i] * wi
                a1 += x1[i] * wi
            out[r, o], out[r + 1, o] = a0 + b, a1 + b
            r += 2
        if r < rows:
            x0 = x[r]
            a0 = np.float32(0.0)
            for i in range(width):
                a0 += x0[i] * widen(w[i])
            out[r, o] = a0 + b


@numba.njit(inline="always")
def _gemv_projection(x: np.ndarray, weights: tuple, layer: int, out: np.ndarray, threads: int) -> None:
    gemv(x, weights[0][layer], weights[1][layer], out)


@numba.njit(inline="always")
def _panel_projection(x: np.ndarray, weights: tuple, layer: int, out: np.ndarray, threads: int) -> None:
    panel_matmul(out, x, weights[0][layer], weights[1][layer], threads)
    after = weights[2][layer]
    if after.shape[0]:
        for r in range(out.shape[0]):
            for i in range(out.shape[1]):
                out[r, i] += after[i]


# The elementwise kernels on one thread or all, by size, as models/fused_ops.py decides for the layer-by-layer path
# (every row is computed the same either way).
@numba.njit(inline="always")
def _add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    if x.size >= PARALLEL_MIN_ELEMENTS:
        add_rms_norm_parallel(x, residual, weight, eps, out)
    else:
        add_rms_norm_serial(x, residual, weight, eps, out)


@numba.njit(inline="always")
def _rotary(qkv: np.ndarray, heads: int, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    if qkv.shape[0] * heads * qkv.shape[2] >= PARALLEL_MIN_ELEMENTS:
        rotary_parallel(qkv, heads, positions, cos, sin)
    else:
        rotary_serial(qkv, heads, positions, cos, sin)


@numba.njit(inline="always")
def _silu_and_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    if out.size >= PARALLEL_MIN_ELEMENTS:
        silu_and_mul_parallel(gate_up, out)
    else:
        silu_and_mul_serial(gate_up, out)


@numba.njit(inline="always")
def _layers(
    project: Callable[[np.ndarray, tuple, int, np.ndarray, int], None], input_ids: np.ndarray, positions: np.ndarray,
    embed: np.ndarray, input_norms: np.ndarray, post_norms: np.ndarray, final_norm: np.ndarray, qkv_weights: tuple,
    o_weights: tuple, gate_up_weights: tuple, down_weights: tuple, qkv_width: int, intermediate: int,
    windows: np.ndarray, cos: np.ndarray, sin: np.ndarray, key_caches: np.ndarray, value_caches: np.ndarray,
    slots: np.ndarray, block_tables: np.ndarray, context_lens: np.ndarray, num_heads: int, num_kv_heads: int,
    eps: np.float32, scale: np.float32, attention_threads: int, threads: int, out: np.ndarray,
) -> None:
    """Each layer as LlamaModel.forward: norm, QKV, rotary on q and k, the new keys/values into their slots, decode
    attention, O, norm, gate/up, SiLU-and-mul, down. ``project(x, weights, layer, out, threads)`` multiplies by one
    projection's ``weights`` (a tuple of its stacks) of ``layer``; ``threads`` is the panel kernel's (a GEMV takes
    Numba's current count)."""
    rows = input_ids.shape[0]
    hidden = embed.shape[1]
    heads = num_heads + 2 * num_kv_heads
    head_size = qkv_width // heads
    residual = np.empty((rows, hidden), dtype=np.float32)
    for r in range(rows):
        for i in range(hidden):
            residual[r, i] = widen(embed[input_ids[r], i])
    x = np.empty((rows, hidden), dtype=np.float32)
    qkv = np.empty((rows, qkv_width), dtype=np.float32)
    attended = np.empty((rows, num_heads, head_size), dtype=np.float32)
    gate_up = np.empty((rows, 2 * intermediate), dtype=np.float32)
    act = np.empty((rows, intermediate), dtype=np.float32)
    no_slopes = np.empty(0, dtype=np.float32)  # the Llama family has no ALiBi
    rms_norm_serial(residual, input_norms[0], eps, x)
    for layer in range(input_norms.shape[0]):
        if layer:
            _add_rms_norm(x, residual, input_norms[layer], eps, x)
        project(x, qkv_weights, layer, qkv, threads)
        qkv3 = qkv.reshape((rows, heads, head_size))
        _rotary(qkv3, num_heads + num_kv_heads, positions, cos, sin)
        key_cache, value_cache = key_caches[layer], value_caches[layer]
        keys, values = qkv3[:, num_heads:num_heads + num_kv_heads], qkv3[:, num_heads + num_kv_heads:]
        if rows >= PARALLEL_MIN_TOKENS:  # as reshape_and_cache decides
            write_parallel(keys, values, key_cache, value_cache, slots)
        else:
            for t in range(rows):
                write_token(keys, values, key_cache, value_cache, slots, t)
        decode_attention(attended, qkv3[:, :num_heads], key_cache.reshape(key_cache.shape[0], key_cache.shape[1],
                         key_cache.shape[2], key_cache.shape[3] * key_cache.shape[4]), value_cache, block_tables,
                         context_lens, no_slopes, scale, windows[layer], attention_threads)
        project(attended.reshape((rows, num_heads * head_size)), o_weights, layer, x, threads)
        _add_rms_norm(x, residual, post_norms[layer], eps, x)
        project(x, gate_up_weights, layer, gate_up, threads)
        _silu_and_mul(gate_up, act)
        project(act, down_weights, layer, x, threads)
    _add_rms_norm(x, residual, final_norm, eps, out)


@numba.njit(_FLOAT32_LAYERS, cache=True, nogil=True)
def decode_layers(
    input_ids: np.ndarray,
    positions: np.ndarray,
    embed: np.ndarray,
    input_norms: np.ndarray,
    post_norms: np.ndarray,
    final_norm: np.ndarray,
    w_qkv: np.ndarray,
    b_qkv: np.ndarray,
    w_o: np.ndarray,
    b_o: np.ndarray,
    w_gate_up: np.ndarray,
    b_gate_up: np.ndarray,
    w_down: np.ndarray,
    b_down: np.ndarray,
    windows: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    key_caches: np.ndarray,
    value_caches: np.ndarray,
    slots: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    eps: np.float32,
    scale: np.float32,
    attention_threads: int,
    out: np.ndarray,
) -> None:
    """The final hidden states of ``input_ids`` (one decode token per sequence) into ``out`` ``[R, hidden]``,
    every projection a GEMV over the dense weights ``[L, out, in]`` (biases added to the sums)."""
    _layers(_gemv_projection, input_ids, positions, embed, input_norms, post_norms, final_norm,
            (w_qkv, b_qkv), (w_o, b_o), (w_gate_up, b_gate_up), (w_down, b_down), w_qkv.shape[1], w_down.shape[2],
            windows, cos, sin, key_caches, value_caches, slots, block_tables, context_lens, num_heads, num_kv_heads,
            eps, scale, attention_threads, 1, out)


@numba.njit(_PANEL_LAYERS, cache=True, nogil=True)
def decode_layers_panels(
    input_ids: np.ndarray,
    positions: np.ndarray,
    embed: np.ndarray,
    input_norms: np.ndarray,
    post_norms: np.ndarray,
    final_norm: np.ndarray,
    p_qkv: np.ndarray,
    b_qkv: np.ndarray,
    p_o: np.ndarray,
    b_o: np.ndarray,
    p_gate_up: np.ndarray,
    b_gate_up: np.ndarray,
    p_down: np.ndarray,
    b_down: np.ndarray,
    windows: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    key_caches: np.ndarray,
    value_caches: np.ndarray,
    slots: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    eps: np.float32,
    scale: np.float32,
    attention_threads: int,
    threads: int,
    out: np.ndarray,
) -> None:
    """As ``decode_layers``, every projection by the panel kernel over ``[L, panels]`` stacks (models/_numba_panels.py)
    on ``threads`` threads. The sums of qkv and gate/up start from their biases, o's and down's biases are added after,
    as the layer-by-layer path computes them: the two paths agree bit for bit."""
    hidden = embed.shape[1]
    no_bias = np.empty((p_qkv.shape[0], 0), dtype=np.float32)
    _layers(_panel_projection, input_ids, positions, embed, input_norms, post_norms, final_norm,
            (p_qkv, b_qkv, no_bias), (p_o, no_bias, b_o), (p_gate_up, b_gate_up, no_bias), (p_down, no_bias, b_down),
            p_qkv.shape[1] // hidden, p_down.shape[1] // hidden, windows, cos, sin, key_caches, value_caches, slots,
            block_tables, context_lens, num_heads, num_kv_heads, eps, scale, attention_threads, threads, out)


def require_bf16() -> None:
    """Compiles the bf16 form of ``decode_layers`` and of the decode attention it calls (or loads them from Numba's
    cache); the float32 forms come with the import."""
    require(decode_attention, ATTENTION_BF16)
    require(decode_layers, _BF16_LAYERS)
