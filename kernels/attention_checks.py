"""Argument checks of the attention kernels (decode and prefill), shared by every backend.

Each check returns what the kernel needs next (cache sizes, the longest
context, the query ranges), so a backend validates with one call and reads the
small metadata tensors back to the host once.
"""

from __future__ import annotations

import math

import torch

from llmserve.kernels.metadata_memo import reduce_once
from llmserve.kernels.validation import (
    KVCacheDims,
    check_block_id_range,
    check_int_tensor,
    check_kv_cache_pair,
    check_positive_int,
    check_same_device,
    check_tensor,
)


def check_paged_attention_args(
    out: object,
    query: object,
    key_cache: object,
    value_cache: object,
    num_kv_heads: object,
    scale: object,
    block_tables: object,
    context_lens: object,
    block_size: object,
    max_context_len: object,
    alibi_slopes: object,
    sliding_window: object,
) -> tuple[KVCacheDims, int]:
    """Validate decode attention's arguments (``paged_attention``); return the cache sizes and the longest context.

    The longest context is 0 for an empty batch. Block ids are checked only in
    the entries the kernel reads: from the first block of the sliding window to
    the last block of the context (the rest of a row may hold anything).
    """
    dims, query = _check_attention_common(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_size, alibi_slopes, sliding_window
    )
    num_seqs = query.shape[0]
    block_tables = check_int_tensor("block_tables", block_tables, 2)
    context_lens = check_int_tensor("context_lens", context_lens, 1)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but query has {num_seqs} sequences")
    if context_lens.shape[0] != num_seqs:
        raise ValueError(f"context_lens has {context_lens.shape[0]} entries but query has {num_seqs} sequences")
    if isinstance(max_context_len, bool) or not isinstance(max_context_len, int) or max_context_len < 0:
        raise ValueError(f"max_context_len must be a non-negative int, got {max_context_len!r}")
    check_same_device(query=query, block_tables=block_tables, context_lens=context_lens)
    if num_seqs == 0:
        return dims, 0

    block_size = dims.block_size

    def reduce() -> tuple[int, int, int, int]:
        ctx = context_lens.long()
        column = torch.arange(block_tables.shape[1], device=ctx.device)
        first = torch.zeros_like(ctx) if sliding_window is None else (ctx - sliding_window).clamp_min(0) // block_size
        read = (column >= first[:, None]) & (column < (ctx[:, None] + block_size - 1) // block_size)
        ids = _read_block_ids(block_tables, read)
        shortest, longest, low, high = torch.stack([ctx.min(), ctx.max(), ids.min(), ids.max()]).tolist()
        return shortest, longest, low, high

    # Once per step, not per layer: the read-back is a GPU synchronization.
    shortest, longest, low, high = reduce_once(block_tables, (context_lens,), ("decode", block_size, sliding_window),
                                               reduce)

    if shortest < 0:
        raise ValueError(f"context_lens must be >= 0, got minimum {shortest}")
    if longest > max_context_len:
        raise ValueError(f"context_lens has {longest} > max_context_len={max_context_len}")
    needed_blocks = -(-longest // block_size)
    if needed_blocks > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns but a context of {longest} tokens "
            f"needs {needed_blocks} blocks of {block_size}"
        )
    check_block_id_range("block_tables (used entries)", low, high, dims.num_blocks)
    return dims, longest


def check_context_attention_args(
    out: object,
    query: object,
    key_cache: object,
    value_cache: object,
    num_kv_heads: object,
    scale: object,
    block_tables: object,
    query_start_loc: object,
    seq_lens: object,
    block_size: object,
    alibi_slopes: object,
    sliding_window: object,
) -> tuple[KVCacheDims, list[int], list[int]]:
    """Validate prefill attention's arguments (``context_attention``); return the cache sizes, ``query_start_loc``
    and ``seq_lens`` as lists (the backends loop or index over them)."""
    dims, query = _check_attention_common(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_size, alibi_slopes, sliding_window
    )
    block_tables = check_int_tensor("block_tables", block_tables, 2)
    query_start_loc = check_int_tensor("query_start_loc", query_start_loc, 1)
    seq_lens = check_int_tensor("seq_lens", seq_lens, 1)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must have {num_seqs + 1} entries (seq_lens has {num_seqs}), "
            f"got {query_start_loc.shape[0]}"
        )
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has {num_seqs} sequences")
    check_same_device(query=query, block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens)

    def read() -> tuple[list[int], list[int], int, int]:
        starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
        low = high = 0
        if lengths:
            needed = (seq_lens.long() + dims.block_size - 1) // dims.block_size
            used = torch.arange(block_tables.shape[1], device=needed.device) < needed[:, None]
            ids = _read_block_ids(block_tables, used)
            low, high = torch.stack([ids.min(), ids.max()]).tolist()
        return starts, lengths, low, high

    # Once per step, not per layer: the read-back is a GPU synchronization. The lists are shared
    # with later calls, so they are copied before they are returned.
    starts, lengths, low, high = reduce_once(block_tables, (query_start_loc, seq_lens), ("prefill", dims.block_size),
                                             read)
    if starts[0] != 0 or starts[-1] != query.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to {query.shape[0]} (num tokens), got {starts}")
    for b, seq_len in enumerate(lengths):
        q_len = starts[b + 1] - starts[b]
        if q_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing, got {starts}")
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: seq_lens={seq_len} is shorter than its {q_len} queries")
        if -(-seq_len // dims.block_size) > block_tables.shape[1]:
            raise ValueError(
                f"sequence {b}: seq_lens={seq_len} needs more than the {block_tables.shape[1]} "
                f"block_tables columns with block_size={dims.block_size}"
            )
    if num_seqs:
        check_block_id_range("block_tables (used entries)", low, high, dims.num_blocks)
    return dims, list(starts), list(lengths)


def _read_block_ids(block_tables: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """The block ids of the entries a kernel reads (``read``: a mask like ``block_tables``), never empty."""
    # A zero (always in range) stands in for unread entries and for an empty table,
    # so that min / max need no special case.
    return torch.nn.functional.pad(torch.where(read, block_tables.long(), 0).flatten(), (0, 1))


def _check_attention_common(
    out: object,
    query: object,
    key_cache: object,
    value_cache: object,
    num_kv_heads: object,
    scale: object,
    block_size: object,
    alibi_slopes: object,
    sliding_window: object,
) -> tuple[KVCacheDims, torch.Tensor]:
    """Checks shared by decode and prefill attention; returns the cache sizes and the query."""
    dims = check_kv_cache_pair(key_cache, value_cache)
    query = check_tensor("query", query, 3)
    out = check_tensor("out", out, 3)
    if not query.dtype.is_floating_point:
        raise ValueError(f"query must be floating point, got {query.dtype}")
    if tuple(out.shape) != tuple(query.shape):
        raise ValueError(f"out shape {tuple(out.shape)} must equal query shape {tuple(query.shape)}")
    if not out.dtype.is_floating_point:
        raise ValueError(f"out must be floating point, got {out.dtype}")
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
    if num_kv_heads != dims.num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} but key_cache has {dims.num_kv_heads} kv heads")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of num_kv_heads={num_kv_heads}")
    if head_size != dims.head_size:
        raise ValueError(f"query head size {head_size} does not match the cache head size {dims.head_size}")
    block_size = check_positive_int("block_size", block_size)
    if block_size != dims.block_size:
        raise ValueError(f"block_size={block_size} but key_cache has block size {dims.block_size}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if alibi_slopes is not None:
        slopes = check_tensor("alibi_slopes", alibi_slopes, 1)
        if slopes.shape[0] != num_heads or not slopes.dtype.is_floating_point:
            raise ValueError(
                f"alibi_slopes must be a floating tensor of shape [{num_heads}], "
                f"got {slopes.dtype} {tuple(slopes.shape)}"
            )
    if sliding_window is not None:
        check_positive_int("sliding_window", sliding_window)
    check_same_device(key_cache=key_cache, query=query, out=out)
    return dims, query
