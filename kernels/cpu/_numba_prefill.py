"""The Numba prefill (context) attention kernel: flash-attention tiles over the paged cache, one block at a time.

Signatures are explicit and ``cache=True``, as in :mod:`llmserve.kernels.cpu._numba_decode`:
importing this module compiles the float32 kernel once per machine, later worker starts load it (the bf16
variant: when a bf16 worker starts).

Work items are (sequence, kv head, query tile). An item computes the ``G`` query heads
of its GQA group for up to ``tq`` consecutive queries together, as the ``G * tq`` rows
of one matrix, so every key/value block is read once per group and tile. It walks the
blocks its queries can see (causal; from the first query's window start with a sliding
window) with an online softmax: memory is O(tile), whatever the context.

Everything is laid out with the rows innermost (rows padded to ``_ROW_STEP``); keys
and values are read where they lie in the cache (a bf16 block widened into a scratch)::

    qt[d, r]      = query of row r (head g, query i: r = g * tq + i), dim d, times scale
    scores[o, r]  = sum_d key(o, d) * qt[d, r]                  (key block [D/x, BS*x])
    acc[d, r]    += sum_o values[d, o] * weights[o, r]          (value block [D, BS])

Both products run as register tiles (``gemm_tile``): 4 slots (or dims) by up to 64 rows
(16 without AVX-512) held in registers over the whole sum, one broadcast element of the block against four
loaded row vectors per step. Written as loops over the rows, every step loaded and
stored its accumulators: measured on 2 cores, 8 prompts of 192 tokens (SmolLM2's
heads), 2.42 ms per layer that way and 1.75 ms this way, with the same results to the bit.

The query goes into ``qt`` and ``acc`` out to the output by 16 x 16 tiles transposed in
registers (``transpose_tile``); element by element, the two took ~11 % of a layer of 64
prompts of 32-256 tokens (2-core Zen 5, the kernel alone, alternating in one process: 12.3 /
13.7 -> 11.3 / 12.4 ms a layer, the same output to the bit).
"""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_blocks import as_float32, finite_slots
from llmserve.kernels.cpu._numba_exp import exp_f32
from llmserve.kernels.cpu._numba_llvm import TRANSPOSE_LANES, fetch_add, gemm_tile, transpose_tile
from llmserve.kernels.cpu.host_cpu import has_avx512
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

_FASTMATH = {"contract"}

# Rows (query heads x queries) per work item. Each row loop pays a fixed cost (alias
# checks, loop set-up), so more rows run faster per multiply-add; 96 measured as fast as
# 128 (64: 25 % slower) and wastes less work on the causal diagonal of short prompts.
_ROWS = 96
# Rows are padded to whole eight-lane vectors (padding rows have a zero query): a loop's
# remainder runs scalar.
_ROW_STEP = 8

# Register tiles of 4 rows x 64 columns (16 vectors of 16 float32) fit AVX-512's 32 vector registers; on
# AVX2's 16 registers of 8 float32 they spill to the stack at every step, and 4 x 16 columns run faster:
# 8 prompts of 256 tokens, SmolLM2's heads, 2 cores of a Zen 1: 24 ms per layer with the wide tiles, 16 without.
# (A global: Numba compiles it in as a constant, and its cache is kept per host CPU.)
_WIDE_TILES = has_avx512()

# How far (in log space) a score may exceed its row's reference maximum before the
# accumulators are rescaled (see _softmax_block): weights stay below e^8 ~ 3000.
_RESCALE_MARGIN = np.float32(8.0)

# (out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, tiles, slopes, scale,
#  sliding_window, threads); caches float32, or bf16 viewed as int16, as in the decode kernel (the bf16 variant
#  compiled when a bf16 worker starts: _numba_variants).
FLOAT32_SIGNATURES, BF16_SIGNATURES = (
    [numba.void(
        numba.float32[:, :, ::1],
        numba.types.Array(numba.float32, 3, "A"),  # the query: a strided view of the fused q/k/v rows is read in place
        cache_type[:, :, :, ::1],
        cache_type[:, :, :, ::1],
        numba.int32[:, ::1],
        numba.int32[::1],
        numba.int32[::1],
        numba.int32[:, ::1],
        numba.float32[::1],
        numba.float32,
        numba.int64,
        numba.int64,
    )]
    for cache_type in (numba.float32, numba.int16)
)


@numba.njit(
    numba.types.Tuple((numba.int32[:, ::1], numba.int64))(
        numba.int32[::1], numba.int32[::1], numba.int64, numba.int64, numba.int64
    ),
    cache=True,
)
def plan_tiles(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, kv_heads: int, group: int, sliding_window: int
) -> tuple[np.ndarray, int]:
    """Work items ``[W, 4]`` (sequence, kv head, first query, end query), most expensive first, and
    their total size: query heads x the keys each tile spans, summed (times ``D``: multiply-adds).

    Threads take items in this order, so the last ones to start are the cheapest and
    threads finish together (a long prompt's late tiles see the most keys).
    """
    tile = max(1, _ROWS // group)
    count = 0
    for b in range(seq_lens.shape[0]):
        count += (query_start_loc[b + 1] - query_start_loc[b] + tile - 1) // tile
    tiles = np.empty((count * kv_heads, 4), dtype=np.int32)
    cost = np.empty(count * kv_heads, dtype=np.int64)
    n = 0
    for b in range(seq_lens.shape[0]):
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        for t0 in range(0, q_len, tile):
            t1 = min(q_len, t0 + tile)
            end = seq_lens[b] - q_len + t1  # one past the tile's last query position
            first = 0 if sliding_window == 0 else max(0, end - (t1 - t0) - sliding_window + 1)
            for h in range(kv_heads):
                tiles[n, 0], tiles[n, 1], tiles[n, 2], tiles[n, 3] = b, h, t0, t1
                cost[n] = group * (t1 - t0) * (end - first)
                n += 1
    return tiles[np.argsort(-cost, kind="mergesort")], cost.sum()


@numba.njit(inline="always", cache=True)
def _rows_times(out: np.ndarray, out_at: int, out_ld: int, a: np.ndarray, a_at: int, a_ld: int, a_group: int,
                a_group_ld: int, b: np.ndarray, depth: int, width: int) -> None:
    """``out[out_at + m * out_ld + r] += sum_k a(m, k) * b[k * width + r]`` for ``m < 4``, ``r < width``.

    ``a(m, k)`` as in ``gemm_tile``, for groups of 1 (a plain row), 4 or 8 (a key block's rows). Four rows of
    ``out`` against all of ``b``'s columns, in register tiles of 64, 32, 16 and 8 columns (``width`` is a
    multiple of ``_ROW_STEP``).
    """
    if a_group == 4:
        _tiles(out, out_at, out_ld, a, a_at, a_ld, 4, a_group_ld, b, depth, width)
    elif a_group == 8:
        _tiles(out, out_at, out_ld, a, a_at, a_ld, 8, a_group_ld, b, depth, width)
    else:
        _tiles(out, out_at, out_ld, a, a_at, a_ld, 1, 1, b, depth, width)


@numba.njit(inline="always", cache=True)
def _tiles(out: np.ndarray, out_at: int, out_ld: int, a: np.ndarray, a_at: int, a_ld: int, a_group: int,
           a_group_ld: int, b: np.ndarray, depth: int, width: int) -> None:
    r = 0
    if _WIDE_TILES:
        while r + 64 <= width:
            gemm_tile(out, out_at + r, out_ld, a, a_at, a_ld, a_group, a_group_ld, b, r, width, depth, 4, 4, 16)
            r += 64
        if r + 32 <= width:
            gemm_tile(out, out_at + r, out_ld, a, a_at, a_ld, a_group, a_group_ld, b, r, width, depth, 4, 2, 16)
            r += 32
    while r + 16 <= width:
        gemm_tile(out, out_at + r, out_ld, a, a_at, a_ld, a_group, a_group_ld, b, r, width, depth, 4, 1, 16)
        r += 16
    if r + 8 <= width:
        gemm_tile(out, out_at + r, out_ld, a, a_at, a_ld, a_group, a_group_ld, b, r, width, depth, 4, 1, 8)


@numba.njit(fastmath=_FASTMATH, cache=True)
def _block_scores(qt: np.ndarray, keys: np.ndarray, scores: np.ndarray) -> None:
    """``scores[o, r] = sum_d key(o, d) * qt[d, r]`` for every slot ``o`` of one block.

    keys: the block in the cache's layout, ``[D/x, BS * x]``: dims ``d .. d+x-1`` of slot ``o``
    are the x consecutive elements from ``[d // x, o * x]`` (x is 4 or 8), read there by the register tiles.
    """
    head_size, width = qt.shape
    block_size = scores.shape[0]
    row = keys.shape[1]
    x = row // block_size
    scores[:] = 0.0
    flat_scores, flat_keys, flat_qt = scores.reshape(scores.size), keys.reshape(keys.size), qt.reshape(qt.size)
    for o in range(0, block_size, 4):
        _rows_times(flat_scores, o * width, width, flat_keys, o * x, x, x, row, flat_qt, head_size, width)


@numba.njit(fastmath=_FASTMATH, cache=True)
def _accumulate_values(probs: np.ndarray, vs: np.ndarray, acc: np.ndarray) -> None:
    """``acc[d, r] += sum_o vs[d, o] * probs[o, r]`` over the slots of one block (``vs``: ``[D, BS]``, finite)."""
    head_size, width = acc.shape
    block_size = probs.shape[0]
    flat_acc, flat_values, flat_probs = acc.reshape(acc.size), vs.reshape(vs.size), probs.reshape(probs.size)
    for d in range(0, head_size, 4):
        _rows_times(flat_acc, d * width, width, flat_values, d * block_size, block_size, 1, 1, flat_probs,
                    block_size, width)


@numba.njit(fastmath=_FASTMATH, cache=True)
def _mask_and_bias(
    scores: np.ndarray, base: int, lo: int, hi: int, p0: int, tq: int, group: int, window: int,
    slopes: np.ndarray, head0: int,
) -> None:  # fmt: skip
    """Scores of keys a row may not see become -inf; ALiBi adds ``slope * (j - p)``.

    Key ``j = base + o`` is visible to query ``i`` (position ``p0 + i``) iff
    ``j <= p0 + i`` and ``j > p0 + i - window``, i.e. for ``i`` in ``[j - p0, j - p0 + window)``::

        i:        0 ........ j-p0 ............ j-p0+window ...... tq
        row:      [  -inf    |     visible      |      -inf      ]
    """
    for o in range(scores.shape[0]):
        row = scores[o]
        if o < lo or o >= hi:
            row[:] = -np.inf
            continue
        j = base + o
        first = min(max(j - p0, 0), tq)
        end = tq if window == 0 else min(max(j - p0 + window, 0), tq)
        for g in range(group):
            if slopes.shape[0] > 0:
                slope = slopes[head0 + g]
                for i in range(tq):
                    row[g * tq + i] += slope * np.float32(j - p0 - i)
            for i in range(first):
                row[g * tq + i] = -np.inf
            for i in range(end, tq):
                row[g * tq + i] = -np.inf


@numba.njit(fastmath=_FASTMATH, cache=True)
def _softmax_block(
    scores: np.ndarray, running_max: np.ndarray, denominator: np.ndarray, acc: np.ndarray, scratch: np.ndarray
) -> None:
    """Online softmax: turn a block's scores into weights ``exp(s - m)`` for each row's reference ``m``.

    ``m`` is the row's running maximum, moved up (and what was accumulated rescaled)
    only when a score exceeds it by more than ``_RESCALE_MARGIN``: weights stay below
    ``e^margin`` (no overflow), and most blocks skip the rescale of ``acc``.
    A row that has seen only -inf keeps ``m = -inf`` and is shifted by 0 instead
    (``exp(-inf - -inf)`` would be NaN); its weights are exactly 0.
    """
    width = running_max.shape[0]
    block_max = scratch
    block_max[:] = running_max
    for o in range(scores.shape[0]):
        row = scores[o]
        for r in range(width):
            # np.maximum, not max(): LLVM turns max() into a masked store here (slow on AMD: 5x).
            block_max[r] = np.maximum(block_max[r], row[r])
    grew = False
    for r in range(width):
        grew |= block_max[r] > running_max[r] + _RESCALE_MARGIN
    if grew:
        correction = scratch  # block_max is read before it is overwritten, row by row
        for r in range(width):
            new_max = block_max[r]
            correction[r] = exp_f32(running_max[r] - (new_max if new_max > -np.inf else np.float32(0.0)))
            running_max[r] = new_max
            denominator[r] *= correction[r]
        for d in range(acc.shape[0]):
            row = acc[d]
            for r in range(width):
                row[r] *= correction[r]
    shift = scratch
    for r in range(width):
        shift[r] = running_max[r] if running_max[r] > -np.inf else np.float32(0.0)
    for o in range(scores.shape[0]):
        row = scores[o]
        for r in range(width):
            weight = exp_f32(row[r] - shift[r])
            row[r] = weight
            denominator[r] += weight


@numba.njit(fastmath=_FASTMATH, cache=True)
def _attend_tile(
    out: np.ndarray, query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, table: np.ndarray,
    kv_head: int, first_token: int, tq: int, p0: int, slopes: np.ndarray, scale: np.float32, window: int,
) -> None:  # fmt: skip
    """One work item: queries ``first_token : first_token + tq`` (positions from ``p0``) of kv head ``kv_head``."""
    num_heads, head_size = query.shape[1], query.shape[2]
    kv_heads, chunks, row = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    block_size = value_cache.shape[3]
    group = num_heads // kv_heads
    head0 = kv_head * group
    width = (group * tq + _ROW_STEP - 1) // _ROW_STEP * _ROW_STEP

    # Padding rows keep a zero query: finite scores, never written out. The query's rows are tokens and qt's
    # columns are, so whole 16 x 16 tiles are transposed in registers, the rest element by element.
    qt = np.zeros((head_size, width), dtype=np.float32)
    lanes = TRANSPOSE_LANES
    in_tiles = head_size % lanes == 0
    token_step, head_step = query.strides[0] // query.itemsize, query.strides[1] // query.itemsize
    scales = np.full(lanes, scale, dtype=np.float32)
    qt_flat = qt.reshape(qt.size)
    for g in range(group):
        done = 0
        if in_tiles and query.strides[2] == query.itemsize:
            while done + lanes <= tq:
                at = (first_token + done) * token_step + (head0 + g) * head_step
                for d in range(0, head_size, lanes):
                    transpose_tile(qt_flat, d * width + g * tq + done, width, query, at + d, token_step, scales, 0)
                done += lanes
        for i in range(done, tq):
            for d in range(head_size):
                qt[d, g * tq + i] = query[first_token + i, head0 + g, d] * scale
    acc = np.zeros((head_size, width), dtype=np.float32)
    scores = np.empty((block_size, width), dtype=np.float32)
    running_max = np.full(width, -np.inf, dtype=np.float32)
    denominator = np.zeros(width, dtype=np.float32)
    scratch = np.empty(width, dtype=np.float32)
    key_bits = np.empty(chunks * row, dtype=np.uint32)
    value_bits = np.empty(head_size * block_size, dtype=np.uint32)
    clean = np.empty((head_size, block_size), dtype=np.float32)

    first_key = 0 if window == 0 else max(0, p0 - window + 1)
    end_key = p0 + tq  # causal: no key past the last query
    for logical in range(first_key // block_size, (end_key - 1) // block_size + 1):
        block = table[logical]
        base = logical * block_size
        # The slots some query of the tile can see; the others may be unwritten (NaN):
        # their scores are overwritten with -inf, their values replaced by zeros.
        lo = max(first_key - base, 0)
        hi = min(end_key - base, block_size)
        keys = as_float32(key_cache[block, kv_head], key_bits)
        values = finite_slots(as_float32(value_cache[block, kv_head], value_bits), lo, hi, clean)
        _block_scores(qt, keys, scores)
        _mask_and_bias(scores, base, lo, hi, p0, tq, group, window, slopes, head0)
        _softmax_block(scores, running_max, denominator, acc, scratch)
        _accumulate_values(scores, values, acc)

    inverse = scratch
    for r in range(group * tq):
        # Every query sees at least its own key: the denominator is positive.
        inverse[r] = np.float32(1.0) / denominator[r]
    # acc's columns are query rows, out's rows are: tiles transposed in registers as the query's were.
    out_flat, acc_flat = out.reshape(out.size), acc.reshape(acc.size)
    token_step = num_heads * head_size
    for g in range(group):
        done = 0
        if in_tiles:
            while done + lanes <= tq:
                at = (first_token + done) * token_step + (head0 + g) * head_size
                for d in range(0, head_size, lanes):
                    transpose_tile(out_flat, at + d, token_step, acc_flat, d * width + g * tq + done, width, inverse,
                                   g * tq + done)
                done += lanes
        for i in range(done, tq):
            for d in range(head_size):
                out[first_token + i, head0 + g, d] = acc[d, g * tq + i] * inverse[g * tq + i]


@numba.njit(FLOAT32_SIGNATURES, parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def context_attention(
    out: np.ndarray, query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, block_tables: np.ndarray,
    query_start_loc: np.ndarray, seq_lens: np.ndarray, tiles: np.ndarray, slopes: np.ndarray, scale: np.float32,
    sliding_window: int, threads: int,
) -> None:  # fmt: skip
    """Prefill attention into ``out`` ``[T, H, D]`` for the work items ``tiles`` (see :func:`plan_tiles`).

    ``slopes`` is empty without ALiBi, ``sliding_window`` 0 without a window; ``threads``: Numba's
    current thread count (an argument: reading it in here would make the kernel uncacheable).
    ``key_cache`` comes as ``[num_blocks, kv_heads, D/x, BS * x]`` (a view of the 5-D cache).
    The caller has validated every argument (block ids of the read entries included).
    """
    # A shared queue, not a prange over the items: each thread takes the next item when it
    # is done with one, so threads finish together even when a core is taken away (and
    # Numba's prange would split the items into fixed contiguous shares).
    next_item = np.zeros(1, dtype=np.int64)
    for _ in numba.prange(threads):
        while True:
            item = fetch_add(next_item)
            if item >= tiles.shape[0]:
                break
            b, kv_head, t0, t1 = tiles[item, 0], tiles[item, 1], tiles[item, 2], tiles[item, 3]
            q0 = query_start_loc[b]
            q_len = query_start_loc[b + 1] - q0
            p0 = seq_lens[b] - q_len + t0
            _attend_tile(
                out, query, key_cache, value_cache, block_tables[b], kv_head, q0 + t0, t1 - t0, p0, slopes, scale,
                sliding_window,
            )  # fmt: skip
