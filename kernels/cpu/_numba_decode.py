"""The Numba decode-attention kernel: one online-softmax pass per (sequence, kv head), reading the cache in place.

Signatures are explicit, so importing this module compiles the kernel (or,
with ``cache=True``, loads it from ``__pycache__``: a worker compiles once per
machine, not per start). It is imported only when a CPU backend is built,
which keeps ``import kernels`` free of Numba.

Per work item (sequence ``s``, kv head ``h``) the ``G`` query heads of the GQA
group are computed together, so each key/value block is read once for all of
them. Blocks are walked in logical order, with no copies: a float32 block is
read where it lies (a bf16 one is widened into a small scratch first). The
inner loops run along the cache's own memory order, as elementwise
multiply-adds that vectorize::

    key_cache[blk, h] as [D/x, BS*x]: row c holds dims c*x .. c*x+x-1 of every slot
        products[o*x + i] += tiled[c, o*x + i] * keys[c, o*x + i]   (tiled: q[c*x + i] repeated per slot)
        score[o] = sum_i products[o*x + i]

    value_cache[blk, h] as [D, BS]:
        wide[d, o] += weight[o] * values[d, o]                       (summed over o once, at the end)
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from kernels.cpu._numba_exp import exp_f32

# Only contraction (a*b+c as one FMA, which rounds once instead of twice). No
# reassociation: the hot loops are written without reductions, so they vectorize
# without it (see _sum_slots for the one exception). No 'nnan'/'ninf': the
# running maxima start at -inf.
_FASTMATH = {"contract"}

# (out, query, key_cache, value_cache, block_tables, context_lens, slopes, scale, sliding_window).
# Caches are float32, or bf16 viewed as int16 (the caller's choice; the kernel tells them apart by dtype).
_SIGNATURES = [
    numba.void(
        numba.float32[:, :, ::1],
        numba.float32[:, :, ::1],
        cache_type[:, :, :, ::1],
        cache_type[:, :, :, ::1],
        numba.int32[:, ::1],
        numba.int32[::1],
        numba.float32[::1],
        numba.float32,
        numba.int64,
    )
    for cache_type in (numba.float32, numba.int16)
]


def _as_float32(block: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """One cache block (any shape) as float32: itself, or widened from bf16 into the scratch ``bits``."""
    raise NotImplementedError("only callable from jitted code")


@overload(_as_float32, inline="always")
def _as_float32_typed(block: types.Array, bits: types.Array) -> object:
    # Picked per cache dtype at compile time: float32 blocks are read in place.
    if isinstance(block.dtype, types.Integer):

        def widen_bf16(block: types.Array, bits: types.Array) -> np.ndarray:
            flat = block.reshape(bits.shape[0])
            for i in range(bits.shape[0]):
                # bf16 is the top half of a float32: its 16 bits shifted up are exactly that float.
                bits[i] = np.uint32(np.uint16(flat[i])) << np.uint32(16)
            return bits.view(np.float32).reshape(block.shape)

        return widen_bf16

    def as_is(block: types.Array, bits: types.Array) -> np.ndarray:
        return block

    return as_is


@numba.njit(inline="always", cache=True)
def _finite_slots(values: np.ndarray, lo: int, hi: int, scratch: np.ndarray) -> np.ndarray:
    """``values`` ``[D, BS]`` with the slots outside ``lo:hi`` zeroed (in ``scratch``) when there are any.

    Slots of a partly used block may be unwritten (NaN in tests), and the
    value loop runs over whole blocks, where probability 0 times NaN is NaN.
    """
    if lo == 0 and hi == values.shape[1]:
        return values
    scratch[:] = 0.0
    for d in range(values.shape[0]):
        for o in range(lo, hi):
            scratch[d, o] = values[d, o]
    return scratch


@numba.njit(fastmath={"contract", "reassoc"}, cache=True)
def _sum_slots(wide: np.ndarray, scale: np.float32, out_row: np.ndarray) -> None:
    """``out_row[d] = scale * sum_o wide[d, o]``: the value accumulator of one query head, reduced over its slots."""
    # Reassociated (vectorized) only here, once per work item: a serial sum over
    # the slots of every dim measured ~10 % of the kernel.
    for d in range(wide.shape[0]):
        total = np.float32(0.0)
        for o in range(wide.shape[1]):
            total += wide[d, o]
        out_row[d] = total * scale


@numba.njit(fastmath={"contract", "reassoc"}, cache=True)
def _block_sum(weights: np.ndarray) -> np.float32:
    """The sum of one block's softmax weights, reassociated so that it vectorizes."""
    total = np.float32(0.0)
    for o in range(weights.shape[0]):
        total += weights[o]
    return total


@numba.njit(_SIGNATURES, parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def decode_attention(
    out: np.ndarray,
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    slopes: np.ndarray,
    scale: np.float32,
    sliding_window: int,
) -> None:
    """Decode attention into ``out`` ``[S, H, D]``.

    ``slopes`` is empty without ALiBi, ``sliding_window`` 0 without a window.
    ``key_cache`` comes as ``[num_blocks, kv_heads, D/x, BS * x]`` (a view of the 5-D cache).
    The caller has validated every argument (block ids of the read entries included).
    """
    num_seqs, num_heads, head_size = query.shape
    kv_heads, chunks, row = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    block_size = value_cache.shape[3]
    x = row // block_size
    group = num_heads // kv_heads
    use_alibi = slopes.shape[0] > 0
    for item in numba.prange(num_seqs * kv_heads):
        s, h = item // kv_heads, item % kv_heads
        ctx = context_lens[s]
        start = 0 if sliding_window == 0 else max(0, ctx - sliding_window)
        # The scaled query laid out like a key block: tiled[g, c, o * x + i] = q[g, c * x + i] for every slot o.
        tiled = np.empty((group, chunks, row), dtype=np.float32)
        for g in range(group):
            for c in range(chunks):
                for o in range(block_size):
                    for i in range(x):
                        tiled[g, c, o * x + i] = query[s, h * group + g, c * x + i] * scale
        # Per-slot partial sums of the weighted values, reduced over the slots at the end.
        wide = np.zeros((group, head_size, block_size), dtype=np.float32)
        running_max = np.full(group, -np.inf, dtype=np.float32)
        denominator = np.zeros(group, dtype=np.float32)
        products = np.empty((group, row), dtype=np.float32)
        weights = np.empty((group, block_size), dtype=np.float32)
        key_bits = np.empty(chunks * row, dtype=np.uint32)
        value_bits = np.empty(head_size * block_size, dtype=np.uint32)
        clean = np.empty((head_size, block_size), dtype=np.float32)
        for logical in range(start // block_size, (ctx + block_size - 1) // block_size):
            block = block_tables[s, logical]
            # The context's slots in this block; the others may be unwritten or outside the window.
            lo = max(start - logical * block_size, 0)
            hi = min(ctx - logical * block_size, block_size)
            keys = _as_float32(key_cache[block, h], key_bits)
            values = _finite_slots(_as_float32(value_cache[block, h], value_bits), lo, hi, clean)
            # q . k of every slot for every query head of the group, each key row read once for all of
            # them: products summed over the chunks, then over each slot's x lanes. Every loop is
            # explicit with whole-row bounds: slice assignments and lo:hi bounds did not vectorize.
            for g in range(group):
                for j in range(row):
                    products[g, j] = tiled[g, 0, j] * keys[0, j]
            for c in range(1, chunks):
                for g in range(group):
                    for j in range(row):
                        products[g, j] += tiled[g, c, j] * keys[c, j]
            for g in range(group):
                block_max = running_max[g]
                for o in range(block_size):
                    score = np.float32(0.0)
                    for i in range(x):
                        score += products[g, o * x + i]
                    if use_alibi:
                        # Distance to the query (the last position): <= 0.
                        score += slopes[h * group + g] * np.float32(logical * block_size + o - (ctx - 1))
                    # Slots outside the context score -inf: the polynomial exp makes their weight exactly 0.
                    score = score if lo <= o < hi else np.float32(-np.inf)
                    weights[g, o] = score
                    block_max = max(block_max, score)
                # Online softmax: rescale what was accumulated under a smaller maximum.
                if block_max > running_max[g]:
                    correction = exp_f32(running_max[g] - block_max)
                    running_max[g] = block_max
                    denominator[g] *= correction
                    for d in range(head_size):
                        for o in range(block_size):
                            wide[g, d, o] *= correction
                for o in range(block_size):
                    weights[g, o] = exp_f32(weights[g, o] - block_max)
                denominator[g] += _block_sum(weights[g])
                for d in range(head_size):
                    for o in range(block_size):
                        wide[g, d, o] += weights[g, o] * values[d, o]
        for g in range(group):
            # An empty context accumulated nothing: its output is defined as zeros.
            inverse = np.float32(1.0) / denominator[g] if denominator[g] > 0 else np.float32(0.0)
            _sum_slots(wide[g], inverse, out[s, h * group + g])
