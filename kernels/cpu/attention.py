"""CPU (torch) attention over the paged KV cache: decode and prefill.

Both kernels read keys/values through block tables (see :mod:`kernels.layout`)
and write ``out`` in place. fp16/bf16 inputs are computed in float32: the
softmax's exp and the long sums over the context lose too much precision in
half types, and CPU half matmuls are not faster anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.kernels.attention_checks import check_context_attention_args, check_paged_attention_args
from llmserve.kernels.cpu._block_gather import compute_dtype_for, contiguous_as, gather_blocks, unwritten_slots
from llmserve.kernels.validation import KVCacheDims

# Sequences per decode chunk are chosen so that one chunk gathers about this many
# key elements (4 MiB in float32). Padding every sequence to the longest context
# would otherwise make the gathered copies batch * max_len * heads * dim; beyond
# a few MiB they leave the CPU caches and the allocator's reusable heap (every
# call page-faults fresh memory), which measured 2-3x slower than 4 MiB chunks.
# Batches of short contexts still run as one chunk.
_DECODE_GATHER_BUDGET = 1 << 20

# Prefill attention runs over query tiles of at most this many scores
# (heads * tile * keys; 16 MiB in float32), so a long prompt's scores and mask
# stay bounded (an ALiBi mask is a float per head, query and key).
_PREFILL_SCORES_BUDGET = 1 << 22


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_context_len: int,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> None:
    """Decode attention: one query per sequence over its cached context; writes ``out`` in place.

    out, query: ``[num_seqs, num_heads, head_size]``.
    block_tables: ``[num_seqs, max_blocks]``; entry ``[s, i]`` is the physical block
    of sequence ``s``'s logical block ``i``. Entries past the used blocks are ignored.
    context_lens: ``[num_seqs]``; sequence ``s`` attends to positions ``0 .. context_lens[s]-1``
    (the query is the token at the last position). A zero length yields a zero output.
    max_context_len: an upper bound on ``context_lens`` (checked).
    num_kv_heads: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)`` (GQA/MQA).
    alibi_slopes: ``[num_heads]``; adds ``slope[h] * (i - (context_len - 1))`` to the score of key position ``i``.
    sliding_window: ``w`` restricts keys to positions ``> context_len - 1 - w`` (the last ``w``).

    Sequences are processed together, padded to the longest context and
    masked; when the gathered keys would exceed a few MiB the batch is split
    into chunks of sequences (see ``_DECODE_GATHER_BUDGET``).
    """
    dims, longest = check_paged_attention_args(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, context_lens, block_size,
        max_context_len, alibi_slopes, sliding_window,
    )  # fmt: skip
    if longest == 0:  # also an empty batch
        out.zero_()
        return

    # Pad to the longest context actually present (read by the checks);
    # max_context_len is only an upper bound and may be loose.
    num_logical_blocks = -(-longest // dims.block_size)
    if sliding_window is not None:
        # The last w positions span at most this many blocks, wherever they start;
        # reading only those makes windowed decode cost O(w), not O(context).
        num_logical_blocks = min(num_logical_blocks, (sliding_window - 1) // dims.block_size + 2)
    per_seq = max(1, num_logical_blocks * dims.block_size * dims.num_kv_heads * dims.head_size)
    chunk = max(1, _DECODE_GATHER_BUDGET // per_seq)
    compute_dtype = compute_dtype_for(query.dtype, key_cache.dtype)
    slopes = None if alibi_slopes is None else alibi_slopes.to(device=query.device, dtype=compute_dtype)
    for start in range(0, query.shape[0], chunk):
        rows = slice(start, start + chunk)
        result = _decode_chunk(
            query[rows],
            key_cache,
            value_cache,
            dims,
            scale,
            block_tables[rows],
            context_lens[rows],
            num_logical_blocks,
            slopes,
            sliding_window,
            compute_dtype,
        )
        out[rows].copy_(result)


def _decode_chunk(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    dims: KVCacheDims,
    scale: float,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_logical_blocks: int,
    slopes: torch.Tensor | None,
    sliding_window: int | None,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """Decode attention for a batch of sequences; returns ``[S, H, D]`` in ``compute_dtype``."""
    num_seqs, num_heads, head_size = query.shape
    kv_heads, block_size = dims.num_kv_heads, dims.block_size
    group = num_heads // kv_heads
    device = query.device
    ctx = context_lens.long()[:, None]  # [S, 1]

    # Logical blocks each sequence reads: all of them, or those overlapping the window.
    block_index = torch.arange(num_logical_blocks, device=device)
    if sliding_window is None:
        logical = block_index.expand(num_seqs, -1)
    else:
        first = torch.div((ctx - sliding_window).clamp_min(0), block_size, rounding_mode="floor")
        logical = first + block_index  # [S, nblk]
    used = logical * block_size < ctx  # block holds at least one token of the context
    table = block_tables.long().gather(1, logical.clamp(max=block_tables.shape[1] - 1))
    # Entries past the used blocks may hold anything (stale ids, -1). Read the
    # sequence's own first block there instead (block 0 for an empty context):
    # always in bounds, and real cache data rather than another tenant's garbage.
    # The used entries' ids were range-checked with the arguments.
    physical = torch.where(used, table, torch.where(used[:, :1], table[:, :1], 0))
    unwritten = unwritten_slots(used, ctx, logical, block_size)

    num_gathered = logical.shape[1]
    length = num_gathered * block_size
    positions = (logical[:, :, None] * block_size + torch.arange(block_size, device=device)).view(num_seqs, length)
    valid = positions < ctx
    if sliding_window is not None:
        valid &= positions > ctx - 1 - sliding_window

    # Keys: gather whole blocks (memcpys), clear unwritten slots, then one pass
    # that both reorders to [S, KVH, D, L] for a plain matmul and casts.
    keys = gather_blocks(key_cache, physical)  # [S, nblk, KVH, D/x, BS, x]
    keys[unwritten[0], unwritten[1], :, :, unwritten[2]] = 0
    keys = contiguous_as(keys.permute(0, 2, 3, 5, 1, 4), compute_dtype).view(num_seqs, kv_heads, head_size, length)
    # Scale the query, not the [S, H, L] scores: fewer multiplies.
    q = (query.to(compute_dtype) * scale).reshape(num_seqs, kv_heads, group, head_size)
    scores = torch.matmul(q, keys)  # [S, KVH, G, L]
    del keys
    # Every gathered key is finite now, so masking can be an additive -inf
    # (several times faster than masked_fill with a broadcast mask).
    bias = torch.zeros(num_seqs, length, dtype=compute_dtype, device=device).masked_fill_(~valid, float("-inf"))
    if slopes is None:
        scores += bias[:, None, None, :]
    else:
        distance = (positions - (ctx - 1)).to(compute_dtype)  # <= 0 for real keys
        scores += torch.addcmul(bias[:, None, None, :], slopes.view(1, kv_heads, group, 1), distance[:, None, None, :])
    probs = torch.softmax(scores, dim=-1)

    # Values stay in gathered block order: each [D, BS] block is already a
    # matrix, so sum_n probs[.., n, :] @ block_n^T needs no reordering copy.
    # Clearing unwritten slots matters here too: probability 0 times NaN is NaN.
    values = gather_blocks(value_cache, physical)  # [S, nblk, KVH, D, BS]
    values[unwritten[0], unwritten[1], :, :, unwritten[2]] = 0
    if values.dtype != compute_dtype:
        values = values.to(compute_dtype)
    probs = probs.view(num_seqs, kv_heads, group, num_gathered, block_size).permute(0, 3, 1, 2, 4)
    result = torch.matmul(probs, values.transpose(-1, -2)).sum(dim=1)  # [S, nblk, KVH, G, D] -> [S, KVH, G, D]
    # An empty context softmaxes all -inf into NaN; define its output as 0.
    result.masked_fill_((ctx == 0).view(num_seqs, 1, 1, 1), 0.0)
    return result.view(num_seqs, num_heads, head_size)


def context_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> None:
    """Prefill attention (full, chunked, or after a prefix-cache hit); writes ``out`` in place.

    out, query: ``[num_tokens, num_heads, head_size]``; sequence ``b`` owns rows
    ``query_start_loc[b] : query_start_loc[b + 1]`` (``q_len_b`` queries).
    seq_lens: ``[B]`` total context per sequence *including* its new queries,
    whose keys/values must already be in the cache (``reshape_and_cache`` first).
    block_tables: ``[B, max_blocks]`` as in :func:`paged_attention`.
    Query ``i`` of sequence ``b`` sits at position ``p = seq_lens[b] - q_len_b + i``
    and attends causally to key positions ``j <= p`` (and ``j > p - sliding_window``);
    ALiBi adds ``slope[h] * (j - p)``.
    """
    # The loop below is per sequence; the checks read the small metadata once, as lists.
    dims, starts, lengths = check_context_attention_args(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, query_start_loc, seq_lens,
        block_size, alibi_slopes, sliding_window,
    )  # fmt: skip
    table = block_tables.long()
    compute_dtype = compute_dtype_for(query.dtype, key_cache.dtype)
    slopes = None if alibi_slopes is None else alibi_slopes.to(device=query.device, dtype=compute_dtype)
    for b, seq_len in enumerate(lengths):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        _prefill_one(
            out[q0:q1],
            query[q0:q1],
            key_cache,
            value_cache,
            dims,
            scale,
            table[b],
            seq_len,
            slopes,
            sliding_window,
            compute_dtype,
        )


def _prefill_one(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    dims: KVCacheDims,
    scale: float,
    table_row: torch.Tensor,
    seq_len: int,
    slopes: torch.Tensor | None,
    sliding_window: int | None,
    compute_dtype: torch.dtype,
) -> None:
    """Causal attention of one sequence's ``[q_len, H, D]`` queries, written into ``out`` (same shape)."""
    q_len, num_heads, head_size = query.shape
    kv_heads, block_size = dims.num_kv_heads, dims.block_size
    group = num_heads // kv_heads
    device = query.device
    first_query = seq_len - q_len

    # Keys no query can see (before the earliest query's window) are skipped entirely.
    kv_start = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
    first_block = kv_start // block_size
    physical = table_row[first_block : -(-seq_len // block_size)]
    num_blocks = physical.shape[0]
    keys = gather_blocks(key_cache, physical)  # [nb, KVH, D/x, BS, x]
    values = gather_blocks(value_cache, physical)  # [nb, KVH, D, BS]
    keys = contiguous_as(keys.permute(1, 0, 3, 2, 4), compute_dtype).view(kv_heads, num_blocks * block_size, head_size)
    values = contiguous_as(values.permute(1, 0, 3, 2), compute_dtype).view(kv_heads, num_blocks * block_size, head_size)
    # Row r of keys/values is position kv_start + r; the last block's tail
    # (never written for this sequence) lies past seq_len and is never sliced in.
    skip = kv_start - first_block * block_size
    keys, values = keys[:, skip:], values[:, skip:]

    # Query tiles bound the [H, tile, kv] scores/mask, and let each tile stop at
    # its own last position: causal attention needs no keys past it.
    tile = max(1, _PREFILL_SCORES_BUDGET // (num_heads * (seq_len - kv_start)))
    q_all = query.to(compute_dtype).transpose(0, 1)  # [H, q_len, D]
    for t0 in range(0, q_len, tile):
        t1 = min(q_len, t0 + tile)
        lo = kv_start if sliding_window is None else max(kv_start, first_query + t0 - sliding_window + 1)
        hi = first_query + t1  # one past the tile's last query position
        key_pos = torch.arange(lo, hi, device=device)
        query_pos = torch.arange(first_query + t0, hi, device=device)[:, None]
        allowed = key_pos <= query_pos  # [tq, kv]
        if sliding_window is not None:
            allowed &= key_pos > query_pos - sliding_window
        # GQA without copying K/V per query head: fold the heads sharing a kv head
        # into the query axis, [H, tq, D] -> [KVH, G * tq, D] (row = g * tq + i).
        tq = t1 - t0
        q = q_all[:, t0:t1].reshape(kv_heads, group * tq, head_size)
        if slopes is None:
            mask = allowed.repeat(group, 1)  # [G * tq, kv], shared by all kv heads
        else:
            bias = slopes[:, None, None] * (key_pos - query_pos).to(compute_dtype)  # [H, tq, kv]
            mask = bias.masked_fill_(~allowed, float("-inf")).view(kv_heads, group * tq, -1)
        k = keys[:, lo - kv_start : hi - kv_start]
        v = values[:, lo - kv_start : hi - kv_start]
        result = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[t0:t1].copy_(result.view(num_heads, tq, head_size).transpose(0, 1))
