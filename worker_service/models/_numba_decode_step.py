"""A decode step of a few sequences through every decoder layer in one compiled call (float32, CPU).

At a few rows a step is bound by reading the weights once, and by the host work around
each op: the layer-by-layer path makes ~20 Python-level calls per layer (oneDNN, Numba
and torch dispatches, tensor views), milliseconds per step on a slow core. Here the
layer loop runs in Numba: each projection is a GEMV over the dense weight
(``gemv``: every weight row read once from memory, at the memory's bandwidth, for all
rows of the step), and the norms, rotary embedding, cache write and decode attention
are the same kernels the layer-by-layer path calls.

Weights are stacked per kind over the layers (``[L, out, in]``), biases ``[L, out]``
or ``[L, 0]`` for none; the caches come stacked over the layers too (one allocation, see
``kernels.layout.stacked_layers``): a Numba typed list of the per-layer arrays compiled its
methods in every worker process, ~0.4 s per list type at the first few-row step.
"""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_bf16 import widen
from llmserve.kernels.cpu._numba_decode import decode_attention
from llmserve.kernels.cpu._numba_llvm import prefetch
from llmserve.kernels.cpu.host_cpu import is_amd_avx512
from llmserve.kernels.cpu.numba_cache_ops import write_token
from llmserve.kernels.numba_cache import versioned_cache
from worker_service.models._numba_ops import add_rms_norm_serial, rms_norm_serial, rotary_serial, silu_and_mul_serial

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

# Explicit signatures: importing this module compiles both functions, or loads them from Numba's cache
# (cache=True), at the worker's start rather than in its first few-row step. Weights, the embedding and the
# caches are float32, or bf16 viewed as int16 (widened as they are read; activations stay float32).
_F32_1D, _F32_2D = numba.float32[::1], numba.float32[:, ::1]
_I64_1D = numba.int64[::1]
_ELEMENTS = (numba.float32, numba.int16)
_GEMVS = [numba.void(_F32_2D, element[:, ::1], _F32_1D, _F32_2D) for element in _ELEMENTS]
_DECODE_LAYERS = [
    numba.void(
        _I64_1D, _I64_1D, element[:, ::1],  # input_ids, positions, embed
        _F32_2D, _F32_2D, _F32_1D,  # input_norms, post_norms, final_norm
        *(element[:, :, ::1], _F32_2D) * 4,  # weights and biases of qkv, o, gate_up, down
        _I64_1D, _F32_2D, _F32_2D,  # windows, cos, sin
        element[:, :, :, :, :, ::1], element[:, :, :, :, ::1],  # key and value caches, all layers
        _I64_1D, numba.int32[:, ::1], numba.int32[::1],  # slots, block_tables, context_lens
        numba.int64, numba.int64, numba.float32, numba.float32, numba.int64,  # heads, kv heads, eps, scale, threads
        _F32_2D,  # out
    )
    for element in _ELEMENTS
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


@numba.njit(_DECODE_LAYERS, cache=True, nogil=True)
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
    """The final hidden states of ``input_ids`` (one decode token per sequence) into ``out`` ``[R, hidden]``.

    Each layer as LlamaModel.forward: norm, QKV, rotary on q and k, the new keys/values
    into their slots, decode attention, O, norm, gate/up, SiLU-and-mul, down.
    """
    rows = input_ids.shape[0]
    hidden = embed.shape[1]
    head_size = w_qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    heads = num_heads + 2 * num_kv_heads
    residual = np.empty((rows, hidden), dtype=np.float32)
    for r in range(rows):
        for i in range(hidden):
            residual[r, i] = widen(embed[input_ids[r], i])
    x = np.empty((rows, hidden), dtype=np.float32)
    qkv = np.empty((rows, heads * head_size), dtype=np.float32)
    attended = np.empty((rows, num_heads, head_size), dtype=np.float32)
    gate_up = np.empty((rows, w_gate_up.shape[1]), dtype=np.float32)
    act = np.empty((rows, w_down.shape[2]), dtype=np.float32)
    no_slopes = np.empty(0, dtype=np.float32)  # the Llama family has no ALiBi
    rms_norm_serial(residual, input_norms[0], eps, x)
    for layer in range(w_qkv.shape[0]):
        if layer:
            add_rms_norm_serial(x, residual, input_norms[layer], eps, x)
        gemv(x, w_qkv[layer], b_qkv[layer], qkv)
        qkv3 = qkv.reshape((rows, heads, head_size))
        rotary_serial(qkv3[:, :num_heads + num_kv_heads], positions, cos, sin)
        key_cache, value_cache = key_caches[layer], value_caches[layer]
        keys, values = qkv3[:, num_heads:num_heads + num_kv_heads], qkv3[:, num_heads + num_kv_heads:]
        for t in range(rows):
            write_token(keys, values, key_cache, value_cache, slots, t)
        decode_attention(attended, qkv3[:, :num_heads], key_cache.reshape(key_cache.shape[0], key_cache.shape[1],
                         key_cache.shape[2], key_cache.shape[3] * key_cache.shape[4]), value_cache, block_tables,
                         context_lens, no_slopes, scale, windows[layer], attention_threads)
        gemv(attended.reshape((rows, num_heads * head_size)), w_o[layer], b_o[layer], x)
        add_rms_norm_serial(x, residual, post_norms[layer], eps, x)
        gemv(x, w_gate_up[layer], b_gate_up[layer], gate_up)
        silu_and_mul_serial(gate_up, act)
        gemv(act, w_down[layer], b_down[layer], x)
    add_rms_norm_serial(x, residual, final_norm, eps, out)
