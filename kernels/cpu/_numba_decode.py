"""The Numba decode-attention kernel: one online-softmax pass per (sequence, kv head), reading the cache in place.

Signatures are explicit, so importing this module compiles the kernel (or,
with ``cache=True``, loads it from ``__pycache__``: a worker compiles once per
machine, not per start). It is imported only when a CPU backend is built,
which keeps ``import kernels`` free of Numba.

Per work item (sequence ``s``, kv head ``h``) the ``G`` query heads of the GQA
group are computed together, so each key/value block is read once for all of
them. Blocks are walked in logical order, with no copies: a float32 block is
read where it lies (a bf16 one is widened into a small scratch first). The
inner loops run along the cache's own memory order, as whole-vector
multiply-adds (``axpy``: one 16-lane FMA per row of 16 slots)::

    key block [D/x, BS*x]: row c holds dims c*x .. c*x+x-1 of every slot
        products[o*x + i] += tiled[c, o*x + i] * keys[c, o*x + i]   (tiled: q[c*x + i] repeated per slot)
        score[o] = sum_i products[o*x + i]

    value block [D, BS]:
        wide[d, o] += weight[o] * values[d, o]                       (summed over o once, at the end)

Work items go to threads from a shared queue (as in the prefill kernel), each
thread with its scratch allocated once per call rather than once per item.
"""

from __future__ import annotations

import numba
import numpy as np

from kernels.cpu._numba_blocks import axpy, flat_block
from kernels.cpu._numba_exp import exp_f32
from kernels.cpu._numba_llvm import fetch_add

# Only contraction (a*b+c as one FMA, which rounds once instead of twice). No
# reassociation: the hot loops are written without reductions, so they vectorize
# without it (see _sum_slots for the one exception). No 'nnan'/'ninf': the
# running maxima start at -inf.
_FASTMATH = {"contract"}

# (out, query, key_cache, value_cache, block_tables, context_lens, slopes, scale, sliding_window, threads).
# Caches are float32, or bf16 viewed as int16 (the caller's choice; the kernel tells them apart by dtype).
_SIGNATURES = [
    numba.void(
        numba.float32[:, :, ::1],
        numba.types.Array(numba.float32, 3, "A"),  # the query: a strided view of the fused q/k/v rows is read in place
        cache_type[:, :, :, ::1],
        cache_type[:, :, :, ::1],
        numba.int32[:, ::1],
        numba.int32[::1],
        numba.float32[::1],
        numba.float32,
        numba.int64,
        numba.int64,
    )
    for cache_type in (numba.float32, numba.int16)
]


@numba.njit(fastmath={"contract", "reassoc"}, cache=True)
def _sum_slots(wide: np.ndarray, block_size: int, scale: np.float32, out_row: np.ndarray) -> None:
    """``out_row[d] = scale * sum_o wide[d * block_size + o]``: one query head's value accumulator, reduced over its slots."""
    # Reassociated (vectorized) only here, once per work item: a serial sum over
    # the slots of every dim measured ~10 % of the kernel.
    for d in range(out_row.shape[0]):
        total = np.float32(0.0)
        for o in range(block_size):
            total += wide[d * block_size + o]
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
    threads: int,
) -> None:
    """Decode attention into ``out`` ``[S, H, D]``.

    ``slopes`` is empty without ALiBi, ``sliding_window`` 0 without a window; ``threads``: Numba's
    current thread count (an argument: reading it in here would make the kernel uncacheable).
    ``key_cache`` comes as ``[num_blocks, kv_heads, D/x, BS * x]`` (a view of the 5-D cache).
    The caller has validated every argument (block ids of the read entries included).
    """
    num_seqs, num_heads, head_size = query.shape
    kv_heads, chunks, row = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    block_size = value_cache.shape[3]
    x = row // block_size
    lane_mask = x - 1  # x, the cache's pack factor, is 16 bytes / element size: 4 or 8, so j % x is j & mask
    group = num_heads // kv_heads
    per_block = head_size * block_size  # elements of one (block, kv head): chunks * row as well
    keys_flat = key_cache.reshape(key_cache.size)
    values_flat = value_cache.reshape(value_cache.size)
    use_alibi = slopes.shape[0] > 0
    items = num_seqs * kv_heads
    next_item = np.zeros(1, dtype=np.int64)
    for _ in numba.prange(threads):
        # The scaled query laid out like a key block: tiled[g, c * row + o * x + i] = q[g, c * x + i].
        tiled = np.empty((group, per_block), dtype=np.float32)
        # Per-slot partial sums of the weighted values, [g, d * block_size + o], reduced over the slots at the end.
        wide = np.empty((group, per_block), dtype=np.float32)
        running_max = np.empty(group, dtype=np.float32)
        denominator = np.empty(group, dtype=np.float32)
        products = np.empty((group, row), dtype=np.float32)  # zeroed per block
        weights = np.empty((group, block_size), dtype=np.float32)
        key_bits = np.empty(per_block, dtype=np.uint32)
        value_bits = np.empty(per_block, dtype=np.uint32)
        while True:
            item = fetch_add(next_item)
            if item >= items:
                break
            s, h = item // kv_heads, item % kv_heads
            ctx = context_lens[s]
            start = 0 if sliding_window == 0 else max(0, ctx - sliding_window)
            for g in range(group):
                q = query[s, h * group + g]
                for c in range(chunks):
                    for j in range(row):
                        tiled[g, c * row + j] = q[c * x + (j & lane_mask)] * scale
                running_max[g] = -np.inf
                denominator[g] = 0.0
                wide[g, :] = 0.0
            for logical in range(start // block_size, (ctx + block_size - 1) // block_size):
                block = block_tables[s, logical]
                # The context's slots in this block; the others may be unwritten or outside the window.
                lo = max(start - logical * block_size, 0)
                hi = min(ctx - logical * block_size, block_size)
                at = (block * kv_heads + h) * per_block
                keys, k0 = flat_block(keys_flat, at, key_bits)
                values, v0 = flat_block(values_flat, at, value_bits)
                # q . k of every slot for every query head of the group, each key row read once for all
                # of them: products summed over the chunks, then over each slot's x lanes.
                for g in range(group):
                    products[g, :] = 0.0
                    for c in range(chunks):
                        axpy(products[g], 0, tiled[g], c * row, keys, k0 + c * row, row)
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
                    # Online softmax: rescale what was accumulated under a smaller maximum (nothing was
                    # before the first block: its accumulators are still zero).
                    if block_max > running_max[g]:
                        if running_max[g] > -np.inf:
                            correction = exp_f32(running_max[g] - block_max)
                            denominator[g] *= correction
                            for j in range(per_block):
                                wide[g, j] *= correction
                        running_max[g] = block_max
                    for o in range(block_size):
                        weights[g, o] = exp_f32(weights[g, o] - block_max)
                    denominator[g] += _block_sum(weights[g])
                    if lo == 0 and hi == block_size:
                        for d in range(head_size):
                            axpy(wide[g], d * block_size, weights[g], 0, values, v0 + d * block_size, block_size)
                    else:
                        # Only the context's slots: the others may hold anything (NaN in tests), and
                        # a weight of 0 times NaN would still be NaN.
                        for d in range(head_size):
                            for o in range(lo, hi):
                                wide[g, d * block_size + o] += weights[g, o] * values[v0 + d * block_size + o]
            for g in range(group):
                # An empty context accumulated nothing: its output is defined as zeros.
                inverse = np.float32(1.0) / denominator[g] if denominator[g] > 0 else np.float32(0.0)
                _sum_slots(wide[g], block_size, inverse, out[s, h * group + g])
