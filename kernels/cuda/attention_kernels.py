"""Numba-CUDA paged attention kernels (vLLM's paged_attention v1/v2 design).

One thread block of NUM_THREADS computes one query row (a decode sequence, or
one prefill query token) for one head, over the row's context positions
``[lo, ctx)`` (``lo > 0`` only with a sliding window)::

    grid = (rows, heads, partitions)            block = 128 threads = 4 warps

    warp w takes KV blocks w, w + 4, w + 8, ... of its range
    inside a warp, thread group g (TGS = 32 // block_size lanes) scores token g of the block:

        lane:   0 1 | 2 3 | 4 5 | ... | 30 31        (block_size 16 -> TGS 2)
        token:   0  |  1  |  2  | ... |  15
        each lane of a group multiplies its share of the head dims, then the
        group sums with xor shuffles

Phases, each ending in a block-wide reduction (shuffles inside a warp, a few
floats of shared memory across warps):

1. scores ``q . k * scale (+ ALiBi)`` into shared ``logits``; block max
2. ``exp(score - max)``; block sum; normalize
3. ``sum_p prob_p * v_p``: each lane owns some head dims and a few adjacent
   tokens of a block (the value cache is token-innermost), lanes sharing a dim
   sum with shuffles, warps combine through shared memory (tree, reusing the
   logits buffer)

Partitioned variant (``partition_size > 0``, vLLM v2): grid z splits the
context into partitions of ``partition_size`` positions; each block writes its
partition's max score, exp-sum and normalized output, and :func:`reduce_kernel`
rescales and combines them. Partitions with no visible position (past the
context, or before the sliding window) exit at once; the reduce skips them too.

Unwritten cache slots (past a context's end in its last block) may hold NaN:
their scores are replaced (not multiplied) by -inf and their values are never
read, so nothing leaks.
"""

from __future__ import annotations

import functools
import math

import torch
from numba import cuda, float32

from llmserve.kernels.cuda._dtypes import LOADERS, STORERS
from llmserve.kernels.cuda._warp import FULL_MASK, WARP_SIZE, shfl_sync, xor_max, xor_sum

NUM_THREADS = 128
NUM_WARPS = NUM_THREADS // WARP_SIZE
_NEG_INF = float32(-math.inf)
_ZERO = float32(0.0)


@cuda.jit(device=True)
def _block_max(value, red, lane, warp):
    """Max of ``value`` over the thread block, returned to every thread (``red``: NUM_WARPS floats of shared)."""
    value = xor_max(value, WARP_SIZE)
    if lane == 0:
        red[warp] = value
    cuda.syncthreads()
    value = red[lane] if lane < NUM_WARPS else _NEG_INF
    value = shfl_sync(FULL_MASK, xor_max(value, NUM_WARPS), 0)
    # Nobody may overwrite `red` (the next reduction) before everyone has read it.
    cuda.syncthreads()
    return value


@cuda.jit(device=True)
def _block_sum(value, red, lane, warp):
    """Sum of ``value`` over the thread block, returned to every thread."""
    value = xor_sum(value, WARP_SIZE)
    if lane == 0:
        red[warp] = value
    cuda.syncthreads()
    value = red[lane] if lane < NUM_WARPS else _ZERO
    value = shfl_sync(FULL_MASK, xor_sum(value, NUM_WARPS), 0)
    cuda.syncthreads()
    return value


def shared_floats(head_size: int, block_size: int, longest: int, partition_size: int) -> int:
    """Floats of dynamic shared memory :func:`attention_kernel` needs: scores, then partial outputs."""
    span = partition_size if partition_size else -(-longest // block_size) * block_size
    return max(span, (NUM_WARPS // 2) * head_size)


@functools.cache
def attention_kernel(
    head_size: int,
    block_size: int,
    partition_size: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    out_dtype: torch.dtype,
):
    """The attention kernel specialized for one shape and dtype combination (compiled on first launch).

    Arguments: ``out [rows, heads, D]``; ``exp_sums, max_logits [rows, heads, parts]`` and
    ``tmp_out [rows, heads, parts, D]`` (float32, partitioned variant only; dummies otherwise);
    ``query [rows, heads, D]``; the two caches; ``queries_per_kv``; ``scale`` (float32);
    ``block_tables``; ``row_seq [rows]`` (block table row of each query row);
    ``row_ctx [rows]`` (positions the row attends to: ``[lo, row_ctx)``);
    ``alibi_slopes`` (float32 ``[heads]`` or empty); ``window`` (0 = none).
    """
    load_q, load_kv, store_out = LOADERS[q_dtype], LOADERS[kv_dtype], STORERS[out_dtype]
    elem = kv_dtype.itemsize
    D, BS, X = head_size, block_size, 16 // elem
    PS = partition_size
    PARTITIONED = partition_size > 0
    # Scores: a thread group per token; each lane reads VEC adjacent dims at a
    # time so that a group reads one 16-byte key chunk together.
    TGS = max(WARP_SIZE // BS, 1)
    VEC = max(16 // (TGS * elem), 1)
    NUM_VECS = D // (TGS * VEC)
    # Values: each lane reads V_VEC adjacent tokens of one dim (16 bytes).
    V_VEC = min(16 // elem, BS)
    V_LANES_PER_DIM = BS // V_VEC
    DIMS_PER_ITER = WARP_SIZE // V_LANES_PER_DIM
    DIMS_PER_LANE = -(-D // DIMS_PER_ITER)
    if D % (TGS * VEC) != 0:
        raise ValueError(f"head_size {D} must be a multiple of {TGS * VEC} with block_size {BS} and {kv_dtype}")

    @cuda.jit
    def kernel(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache,
        queries_per_kv, scale, block_tables, row_seq, row_ctx, alibi_slopes, window,
    ):  # fmt: skip
        row = cuda.blockIdx.x
        head = cuda.blockIdx.y
        part = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid // WARP_SIZE
        lane = tid % WARP_SIZE
        ctx = row_ctx[row]
        # (Conditionals instead of max/min: numba's CUDA target mis-resolves the builtins on ints.)
        lo = ctx - window if window > 0 and ctx > window else 0
        if PARTITIONED:
            t_start = part * PS
            if t_start >= ctx or t_start + PS <= lo:
                return  # nothing visible in this partition (the reduce skips it too)
            t_end = ctx if ctx < t_start + PS else t_start + PS
        else:
            if ctx == 0:
                for d in range(tid, D, NUM_THREADS):
                    out[row, head, d] = store_out(_ZERO)
                return
            t_start = 0
            t_end = ctx
        start_block = (t_start if t_start > lo else lo) // BS
        end_block = (t_end + BS - 1) // BS
        base = start_block * BS  # logits[i] holds position base + i
        span = end_block * BS - base
        seq = row_seq[row]
        kv_head = head // queries_per_kv

        q_s = cuda.shared.array(D, float32)
        red = cuda.shared.array(NUM_WARPS, float32)
        logits = cuda.shared.array(0, float32)
        for d in range(tid, D, NUM_THREADS):
            q_s[d] = load_q(query[row, head, d])
        cuda.syncthreads()
        slope = alibi_slopes[head] if alibi_slopes.shape[0] > 0 else _ZERO

        # 1. Scores.
        qk_max = _NEG_INF
        group_lane = lane % TGS
        token = lane // TGS
        for blk in range(start_block + warp, end_block, NUM_WARPS):
            physical = block_tables[seq, blk]
            qk = _ZERO
            for j in range(NUM_VECS):
                d0 = (group_lane + j * TGS) * VEC
                for k in range(VEC):
                    d = d0 + k
                    qk += q_s[d] * load_kv(key_cache[physical, kv_head, d // X, token, d % X])
            qk = xor_sum(qk, TGS)
            pos = blk * BS + token
            if group_lane == 0:
                if pos >= lo and pos < ctx:
                    score = qk * scale + slope * float32(pos - ctx + 1)
                    logits[pos - base] = score
                    if score > qk_max:
                        qk_max = score
                else:
                    logits[pos - base] = _NEG_INF
        qk_max = _block_max(qk_max, red, lane, warp)

        # 2. Softmax over the span (finite max: the span has a visible position).
        exp_sum = _ZERO
        for i in range(tid, span, NUM_THREADS):
            e = math.exp(logits[i] - qk_max)
            logits[i] = e
            exp_sum += e
        exp_sum = _block_sum(exp_sum, red, lane, warp)
        inv_sum = float32(1.0) / exp_sum
        for i in range(tid, span, NUM_THREADS):
            logits[i] *= inv_sum
        cuda.syncthreads()
        if PARTITIONED and tid == 0:
            max_logits[row, head, part] = qk_max
            exp_sums[row, head, part] = exp_sum

        # 3. Probability-weighted values.
        accs = cuda.local.array(DIMS_PER_LANE, float32)
        for i in range(DIMS_PER_LANE):
            accs[i] = _ZERO
        v_offset = (lane % V_LANES_PER_DIM) * V_VEC
        first_dim = lane // V_LANES_PER_DIM
        for blk in range(start_block + warp, end_block, NUM_WARPS):
            physical = block_tables[seq, blk]
            pos0 = blk * BS + v_offset
            for i in range(DIMS_PER_LANE):
                dim = first_dim + i * DIMS_PER_ITER
                if dim < D:
                    acc = _ZERO
                    for k in range(V_VEC):
                        pos = pos0 + k
                        if pos >= lo and pos < ctx:
                            acc += logits[pos - base] * load_kv(value_cache[physical, kv_head, dim, v_offset + k])
                    accs[i] += acc
        for i in range(DIMS_PER_LANE):
            accs[i] = xor_sum(accs[i], V_LANES_PER_DIM)
        cuda.syncthreads()  # the logits are consumed: their buffer now collects partial outputs

        writer = lane % V_LANES_PER_DIM == 0  # one lane per dim holds the warp's sum
        active = NUM_WARPS
        while active > 1:
            half = active // 2
            if warp >= half and warp < active and writer:
                for i in range(DIMS_PER_LANE):
                    dim = first_dim + i * DIMS_PER_ITER
                    if dim < D:
                        logits[(warp - half) * D + dim] = accs[i]
            cuda.syncthreads()
            if warp < half and writer:
                for i in range(DIMS_PER_LANE):
                    dim = first_dim + i * DIMS_PER_ITER
                    if dim < D:
                        accs[i] += logits[warp * D + dim]
            cuda.syncthreads()
            active = half

        if warp == 0 and writer:
            for i in range(DIMS_PER_LANE):
                dim = first_dim + i * DIMS_PER_ITER
                if dim < D:
                    if PARTITIONED:
                        tmp_out[row, head, part, dim] = accs[i]
                    else:
                        out[row, head, dim] = store_out(accs[i])

    return kernel


@functools.cache
def reduce_kernel(head_size: int, partition_size: int, out_dtype: torch.dtype):
    """Combines the partitions written by the partitioned :func:`attention_kernel` into ``out``.

    Grid ``(rows, heads)``; dynamic shared memory: one float per partition.
    Output = sum_p tmp_out_p * w_p / sum_p w_p with w_p = exp_sum_p * exp(max_p - max).
    """
    store_out = STORERS[out_dtype]
    D, PS = head_size, partition_size

    @cuda.jit
    def kernel(out, exp_sums, max_logits, tmp_out, row_ctx, window):
        row = cuda.blockIdx.x
        head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // WARP_SIZE
        lane = tid % WARP_SIZE
        ctx = row_ctx[row]
        if ctx == 0:
            for d in range(tid, D, NUM_THREADS):
                out[row, head, d] = store_out(_ZERO)
            return
        lo = ctx - window if window > 0 and ctx > window else 0
        first = lo // PS
        count = (ctx - 1) // PS - first + 1

        red = cuda.shared.array(NUM_WARPS, float32)
        weights = cuda.shared.array(0, float32)
        global_max = _NEG_INF
        for p in range(tid, count, NUM_THREADS):
            m = max_logits[row, head, first + p]
            weights[p] = m
            if m > global_max:
                global_max = m
        global_max = _block_max(global_max, red, lane, warp)
        total = _ZERO
        for p in range(tid, count, NUM_THREADS):
            w = exp_sums[row, head, first + p] * math.exp(weights[p] - global_max)
            weights[p] = w
            total += w
        total = _block_sum(total, red, lane, warp)  # its barrier also publishes `weights`
        inv_total = float32(1.0) / total
        for d in range(tid, D, NUM_THREADS):
            acc = _ZERO
            for p in range(count):
                acc += tmp_out[row, head, first + p, d] * weights[p]
            out[row, head, d] = store_out(acc * inv_total)

    return kernel
