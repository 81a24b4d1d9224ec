"""The Numba decode-attention kernel: per sequence (or kv head), the softmax taken over spans of blocks, the cache read in place.

Signatures are explicit, so importing this module compiles the kernel for float32
caches (or, with ``cache=True``, loads it from ``__pycache__``: a worker compiles once per
machine, not per start); the bf16 variant is compiled when a bf16 worker starts
(:mod:`llmserve.kernels.cpu._numba_variants`). It is imported only when a CPU backend is built,
which keeps ``import kernels`` free of Numba.

Per work item (a sequence's kv heads: all of them, or one each when there are too few
sequences to share among the threads) every query head is computed, each kv head's
``G`` GQA query heads together, so each key/value block is read once for all of
them, with no copies: a float32 block is read where it lies (a bf16 one is
widened into a scratch first). The context is taken in spans of up to
``_SPAN_BLOCKS`` blocks, each in three passes along the cache's own memory order::

    keys, block [D/x, BS*x], row c holding dims c*x .. c*x+x-1 of every slot:
        lanes[o*x + i] = sum_c q[c*x + i] * keys[c, o*x + i]          (q's x dims repeated along the row)
        score[o] = sum_i lanes[o*x + i]
    softmax numerators of the span's scores: max, exp and sum as loops over all its slots
    values, block [D, BS]:
        wide[d, o] += weight[o] * values[d, o]                       (summed over o once, at the end)

The sums over c (key rows) and over runs of up to ``_RUN_BLOCKS`` of the span's blocks
(values) run in registers, 64 lanes at a time (``weighted_sum``), in a fixed order: a
thread's result does not depend on the thread count. The group's query heads take turns
on each block (keys) or on each 64 lanes of a run's blocks (values), so that what one
head fetched the others read from L1. On AVX-512 they take them in tiles of 2-4 heads
(``weighted_sums``) that load each row once into registers for all of the tile's running
sums: one head at a time, the loads bound the loops. The same output bit for bit, 64
sequences on a 2-core Zen 4, 30 layers: 13.1-13.6 -> 7.9-8.0 ms a step with the cache in
L1/L2 at 144 tokens, 25.7-27.4 -> 19.2-20.6 ms out of the caches (24.1 -> 19.6-20.7 ms
inside the worker's step at 128-token prompts). Spans are joined by the online softmax's
rescaling (contexts up to ``_SPAN_BLOCKS`` blocks take one span). Measured on 2 cores, 64 sequences of 256
tokens, 30 layers: 68 ms per step when the kernel kept every partial sum in memory
and took the softmax block by block, 31 ms this way (a Zen 5).

Whole sequences as items read a block's kv heads as one 12 KiB stretch (the default
model's 3) instead of three scattered 4 KiB pieces: random 4 KiB pieces read at 14-18 GB/s
on a 2-core Zen 3 where 8 KiB ones read at 18-20 and 64 KiB ones at 29. There, 64 sequences,
30 layers, alternating in one process, the same output bit for bit: 26.3 -> 24.5 ms a step at
128 tokens, 59.4 / 61.9 -> 53.9 / 49.3 ms at 256, 83.3 -> 74.2 ms at 400 (bf16 caches at 256:
60.2 -> 52.6 ms).

The loops over a span's slots (scores, maximum, exp, sum) index a slice view from 0
(``row = scores[at:at + n]; row[o]``), not the whole array at ``at + o``: Numba
wraps negative indices, and LLVM, unable to prove ``at + o >= 0``, kept those loops
scalar (an exp per slot). On a Zen 1 this took 13-23 % off the kernel.

Work items go to threads from a shared queue (as in the prefill kernel), each
thread with its scratch allocated once per call rather than once per item.
"""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_blocks import flat_block, head_tile, weighted_sum, weighted_sums
from llmserve.kernels.cpu._numba_exp import exp_f32
from llmserve.kernels.cpu._numba_llvm import fetch_add, max_lanes, row_sums
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

# Only contraction (a*b+c as one FMA, which rounds once instead of twice). No
# reassociation: the hot loops are written without reductions, so they vectorize
# without it (see _sum_slots, _sum and _max for the exceptions). No 'nnan'/'ninf': the
# running maxima start at -inf.
_FASTMATH = {"contract"}

# (out, query, key_cache, value_cache, block_tables, context_lens, slopes, scale, sliding_window, threads).
# Caches are float32, or bf16 viewed as int16 (the caller's choice; the kernel tells them apart by dtype).
# The float32 variant is compiled at import, the bf16 one by `_numba_variants.require` (BF16_SIGNATURES).
FLOAT32_SIGNATURES, BF16_SIGNATURES = (
    [numba.void(
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
    )]
    for cache_type in (numba.float32, numba.int16)
)

# Blocks whose softmax is taken in one pass (512 slots of 16): scores of a whole span are computed
# first, then their maximum, exponentials and sum as long vectorized loops, then the weighted values.
# Longer contexts take several spans, joined by the online-softmax rescaling.
_SPAN_BLOCKS = 32
# Lanes of the value blocks summed at a time (weighted_sum's register width: eight AVX2 vectors).
_LANES = 64
# Value blocks whose lanes are summed in one pass. The same 64 lanes of different blocks lie at the same
# offset within a 4 KiB page (one (block, kv head) of 16 float32 slots x 64 dims is 4 KiB), so they share
# L1 sets: the lanes of a whole span (16 or 32 blocks) overflowed the L1's 8 ways, and the group's second
# and third query heads read them again from L2. Runs of 8 stay in L1. Measured on a 2-core Zen 3, 64
# sequences of 256 tokens, 30 layers, alternating: 61.8 -> 55.1 ms a step over a cache out of the CPU's
# caches, 30.7-35.2 -> 25.5-29.1 ms within them; the same output, bit for bit.
_RUN_BLOCKS = 8
# The most bytes of a block's kv heads one work item reads side by side. A whole sequence of the default model
# (3 kv heads x 4 KiB); no more, as an item's scratch grows with its query heads (lanes, scores and value sums:
# ~130 KiB a thread for the default model's 9 heads), and models with many heads would leave L2 for it.
_ITEM_BYTES = 12 * 1024


@numba.njit(fastmath={"contract", "reassoc"}, cache=True)
def _sum_slots(wide: np.ndarray, at: int, block_size: int, scale: np.float32, out_row: np.ndarray) -> None:
    """``out_row[d] = scale * sum_o wide[at + d * block_size + o]``: one query head's value accumulator, reduced
    over its slots.

    Once per work item and query head. Block sizes 16 and 8 (with head sizes their multiple) as a tree of
    vector shuffles (``row_sums``): a serial sum over the slots of every dim, even reassociated, took
    ~220 ns per head of 64 dims, ~1.9 ms of a 64-sequence step.
    """
    head_size = out_row.shape[0]
    if block_size == 16 and head_size % 16 == 0:
        row_sums(wide, at, out_row, 0, head_size, scale, 16)
    elif block_size == 8 and head_size % 8 == 0:
        row_sums(wide, at, out_row, 0, head_size, scale, 8)
    else:
        for d in range(head_size):
            total = np.float32(0.0)
            for o in range(block_size):
                total += wide[at + d * block_size + o]
            out_row[d] = total * scale


@numba.njit(fastmath={"contract", "reassoc"}, cache=True)
def _sum(values: np.ndarray, at: int, n: int) -> np.float32:
    """``sum(values[at:at + n])``, reassociated so that it vectorizes (the softmax denominator)."""
    row = values[at:at + n]
    total = np.float32(0.0)
    for j in range(row.shape[0]):
        total += row[j]
    return total


@numba.njit(cache=True)
def max_of(values: np.ndarray, at: int, n: int) -> np.float32:
    """``max(values[at:at + n])`` in vector lanes (``max_lanes``); ``-inf`` for ``n == 0``, a NaN skipped.

    Here the scores it reads are masked with -inf, never NaN; the CPU sampler takes it for its rows too (the
    log-normaliser's and the race's row maxima, NaN rows sent to torch before).
    """
    return max_lanes(values, at, n)


@numba.njit(inline="always", cache=True)
def _slot_scores(lanes: np.ndarray, at: int, scores: np.ndarray, to: int, n: int, x: int) -> None:
    """``scores[to + o] = sum_i lanes[at + o * x + i]`` for ``o < n``: each slot's x per-lane products, summed in order.

    Written out for the cache's two pack factors, x = 4 (float32) and 8 (bf16; x is 16 bytes over the
    element size), so that the loop over the slots vectorizes.
    """
    out = scores[to:to + n]
    if x == 4:
        products = lanes[at:at + 4 * n]
        for o in range(out.shape[0]):
            j = 4 * o
            out[o] = products[j] + products[j + 1] + products[j + 2] + products[j + 3]
    else:
        products = lanes[at:at + 8 * n]
        for o in range(out.shape[0]):
            j = 8 * o
            out[o] = (products[j] + products[j + 1] + products[j + 2] + products[j + 3] + products[j + 4]
                      + products[j + 5] + products[j + 6] + products[j + 7])


@numba.njit(inline="always", cache=True)
def _used_slots(values: np.ndarray, values_at: int, lo: int, hi: int, head_size: int, block_size: int,
                out: np.ndarray) -> None:
    """``out[d * BS + o] = values[values_at + d * BS + o]`` for the slots ``max(lo, 0) <= o < min(hi, BS)`` of a
    value block, 0 for the others."""
    lo, hi = max(lo, 0), min(hi, block_size)
    block = values[values_at:values_at + head_size * block_size]
    for d in range(head_size):
        for o in range(block_size):
            out[d * block_size + o] = block[d * block_size + o] if lo <= o < hi else np.float32(0.0)


@numba.njit(inline="always", fastmath=_FASTMATH, cache=True)
def _add_alibi(scores: np.ndarray, at: int, n: int, slope: np.float32, first_distance: int) -> None:
    """``scores[at + o] += slope * (first_distance + o)``: ALiBi's bias by distance to the query."""
    row = scores[at:at + n]
    for o in range(row.shape[0]):
        row[o] += slope * np.float32(first_distance + o)


@numba.njit(inline="always", cache=True)
def _mask_outside(scores: np.ndarray, at: int, n: int, lo: int, hi: int) -> None:
    """``scores[at + o] = -inf`` for the slots ``o`` outside ``[lo, hi)``: two short loops, no test per slot."""
    for o in range(min(lo, n)):
        scores[at + o] = -np.inf
    for o in range(max(hi, 0), n):
        scores[at + o] = -np.inf


@numba.njit(inline="always", fastmath=_FASTMATH, cache=True)
def _exp_shifted(scores: np.ndarray, at: int, n: int, shift: np.float32) -> None:
    """``scores[at + o] = exp(scores[at + o] - shift)``, eight lanes at a time."""
    row = scores[at:at + n]
    for o in range(row.shape[0]):
        row[o] = exp_f32(row[o] - shift)


@numba.njit(FLOAT32_SIGNATURES, parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
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
    group = num_heads // kv_heads
    # Query heads whose sums share each loaded key / value row (weighted_sums), where the shapes are those its
    # loops are compiled for: 64-lane key rows and value blocks, 16-slot blocks, the float32 or bf16 pack factor.
    tiled = row % 64 == 0 and head_size * block_size % 64 == 0 and block_size == 16 and (x == 4 or x == 8)
    tile = head_tile(group) if tiled else 1
    per_block = head_size * block_size  # elements of one (block, kv head): chunks * row as well
    span = _SPAN_BLOCKS * block_size  # slots of one span
    keys_flat = key_cache.reshape(key_cache.size)
    values_flat = value_cache.reshape(value_cache.size)
    use_alibi = slopes.shape[0] > 0
    widen = key_cache.itemsize == 2  # bf16 (as int16), widened block by block
    # A work item: the kv heads [h_first, h_first + per_item) of one sequence. A block's kv heads lie side by
    # side, so an item of several reads one stretch per block instead of scattered pieces (the hardware
    # prefetchers start over at every piece): as many as fit in _ITEM_BYTES (the default model's 3 x 4 KiB)
    # when there are sequences enough to keep the threads busy. One kv head per item for a few sequences, so
    # that the threads share even one sequence, and where one head's piece is already that long.
    per_item = 1
    if num_seqs >= 2 * threads:
        for count in range(kv_heads, 1, -1):
            if kv_heads % count == 0 and count * per_block * key_cache.itemsize <= _ITEM_BYTES:
                per_item = count
                break
    parts = kv_heads // per_item
    heads = per_item * group  # query heads of an item
    item_block = per_item * per_block  # elements of an item's share of one block
    items = num_seqs * parts
    next_item = np.zeros(1, dtype=np.int64)
    for _ in numba.prange(threads):
        # Per query head g of the item, flat: the scaled query; the span's per-lane q.k products
        # (lanes[g * span * x + slot * x + i]) and then its scores / softmax weights (scores[g * span + slot]);
        # per-slot partial sums of the weighted values (wide[g * per_block + d * block_size + o], reduced over
        # the slots at the end). Query head g reads kv head h_first + g // group.
        scaled = np.empty(heads * head_size, dtype=np.float32)
        lanes = np.empty(heads * span * x, dtype=np.float32)
        scores = np.empty(heads * span, dtype=np.float32)
        wide = np.empty(heads * per_block, dtype=np.float32)
        running_max = np.empty(heads, dtype=np.float32)
        denominator = np.empty(heads, dtype=np.float32)
        # Where the item's share of each block of the span lies (in the cache, or widened from bf16 into the bits
        # scratch); its kv heads follow one another per_block elements apart.
        key_offsets = np.empty(_SPAN_BLOCKS, dtype=np.int64)
        value_offsets = np.empty(_SPAN_BLOCKS, dtype=np.int64)
        key_bits = np.empty(item_block * _SPAN_BLOCKS if widen else 0, dtype=np.uint32)
        value_bits = np.empty(item_block * _SPAN_BLOCKS if widen else 0, dtype=np.uint32)
        # Where each row of a key block starts in it, as weighted_sum steps through them.
        chunk_offsets = np.arange(chunks) * row
        # A partly used value block with its unused slots zeroed, and its one offset.
        partial = np.empty(per_block, dtype=np.float32)
        zero_offset = np.zeros(1, dtype=np.int64)
        while True:
            item = fetch_add(next_item)
            if item >= items:
                break
            s, h_first = item // parts, (item % parts) * per_item
            q_first = h_first * group  # the item's first query head
            ctx = context_lens[s]
            start = 0 if sliding_window == 0 else max(0, ctx - sliding_window)
            for g in range(heads):
                for d in range(head_size):
                    scaled[g * head_size + d] = query[s, q_first + g, d] * scale
                running_max[g] = -np.inf
                denominator[g] = 0.0
                wide[g * per_block:(g + 1) * per_block] = 0.0
            first, last = start // block_size, (ctx + block_size - 1) // block_size
            for span_first in range(first, last, _SPAN_BLOCKS):
                n = min(_SPAN_BLOCKS, last - span_first)
                slots = n * block_size
                span_start = span_first * block_size  # the context position of the span's first slot
                for b in range(n):
                    at = (block_tables[s, span_first + b] * kv_heads + h_first) * per_block
                    keys, key_offsets[b] = flat_block(keys_flat, at, item_block, key_bits, b * item_block)
                    values, value_offsets[b] = flat_block(values_flat, at, item_block, value_bits, b * item_block)
                # q . k of every slot. Block by block, a tile of query heads at a time: a kv head's block (4 KiB
                # for 16 slots of 64 dims) is fetched once, each row loaded once per tile and read again from L1 by
                # the group's other tiles.
                for g in range(heads):
                    lanes[g * span * x:g * span * x + slots * x] = 0.0
                for b in range(n):
                    if tile == 1:
                        for g in range(heads):
                            weighted_sum(lanes, g * span * x + b * row, scaled, g * head_size, x, x, keys,
                                         key_offsets[b] + (g // group) * per_block, chunk_offsets, chunks, row)
                    elif x == 4:
                        for g in range(0, heads, tile):
                            weighted_sums(lanes, g * span * x + b * row, span * x, scaled, g * head_size, head_size,
                                          x, 4, keys, key_offsets[b] + (g // group) * per_block, chunk_offsets,
                                          chunks, row, tile)
                    else:
                        for g in range(0, heads, tile):
                            weighted_sums(lanes, g * span * x + b * row, span * x, scaled, g * head_size, head_size,
                                          x, 8, keys, key_offsets[b] + (g // group) * per_block, chunk_offsets,
                                          chunks, row, tile)
                # The span's softmax weights, one pass over all its slots per query head: slots outside the
                # context (unwritten, or before the window) score -inf, which the polynomial exp makes exactly 0.
                # Slots [valid_lo, valid_hi) of the span are in the context (and the window).
                valid_lo, valid_hi = max(start - span_start, 0), min(ctx - span_start, slots)
                for g in range(heads):
                    base = g * span
                    _slot_scores(lanes, g * span * x, scores, base, slots, x)
                    if use_alibi:
                        # Distance to the query (the last position): <= 0.
                        _add_alibi(scores, base, slots, slopes[q_first + g], span_start - (ctx - 1))
                    _mask_outside(scores, base, slots, valid_lo, valid_hi)
                    span_max = max_of(scores, base, slots)
                    # Online softmax across spans: rescale what earlier spans accumulated under a smaller maximum.
                    if span_max > running_max[g]:
                        if running_max[g] > -np.inf:
                            correction = exp_f32(running_max[g] - span_max)
                            denominator[g] *= correction
                            for j in range(g * per_block, (g + 1) * per_block):
                                wide[j] *= correction
                        running_max[g] = span_max
                    _exp_shifted(scores, base, slots, running_max[g])
                    denominator[g] += _sum(scores, base, slots)
                # The weighted values: the whole blocks (64 lanes of them in registers at a time), then a partly
                # used first block (under a window) and a partly used last one.
                whole_first = 1 if start > span_start else 0  # the window starts inside the first block
                whole_last = n - 1 if ctx < span_start + slots else n  # the context ends inside the last one
                # 64 lanes of up to _RUN_BLOCKS whole blocks at a time, for each tile of query heads of the kv head
                # in turn: those lanes (~2 KiB) are read again from L1 by the group's other tiles. Each lane's sum
                # still runs over the blocks in order (it waits in `wide` between runs), so the runs do not change
                # the rounding.
                for run_first in range(whole_first, whole_last, _RUN_BLOCKS):
                    run_last = min(run_first + _RUN_BLOCKS, whole_last)
                    run = value_offsets[run_first:run_last]
                    for kv in range(per_item):
                        for i in range(0, per_block, _LANES):
                            # Lanes i.. hold slots i % BS.. of a value row (no wrap inside 64 lanes: BS divides 64
                            # or 64 divides BS).
                            lanes_i, slot_i = min(_LANES, per_block - i), i % block_size
                            if tile == 1:
                                for g in range(kv * group, (kv + 1) * group):
                                    weighted_sum(wide, g * per_block + i, scores,
                                                 g * span + run_first * block_size + slot_i, block_size, block_size,
                                                 values, kv * per_block + i, run, run_last - run_first, lanes_i)
                            else:
                                for g in range(kv * group, (kv + 1) * group, tile):
                                    weighted_sums(wide, g * per_block + i, per_block, scores,
                                                  g * span + run_first * block_size + slot_i, span, block_size, 16,
                                                  values, kv * per_block + i, run, run_last - run_first, lanes_i,
                                                  tile)
                for b in range(n):
                    if whole_first <= b < whole_last:
                        continue
                    # A partly used block: its slots outside the context may hold anything (NaN in tests), and a
                    # weight of 0 times NaN would still be NaN, so they are zeroed in a copy first.
                    lo, hi = valid_lo - b * block_size, valid_hi - b * block_size
                    for kv in range(per_item):
                        _used_slots(values, value_offsets[b] + kv * per_block, lo, hi, head_size, block_size,
                                    partial)
                        if tile == 1:
                            for g in range(kv * group, (kv + 1) * group):
                                weighted_sum(wide, g * per_block, scores, g * span + b * block_size, block_size,
                                             block_size, partial, 0, zero_offset, 1, per_block)
                        else:
                            for g in range(kv * group, (kv + 1) * group, tile):
                                weighted_sums(wide, g * per_block, per_block, scores, g * span + b * block_size,
                                              span, block_size, 16, partial, 0, zero_offset, 1, per_block, tile)
            for g in range(heads):
                # An empty context accumulated nothing: its output is defined as zeros.
                inverse = np.float32(1.0) / denominator[g] if denominator[g] > 0 else np.float32(0.0)
                _sum_slots(wide, g * per_block, block_size, inverse, out[s, q_first + g])
