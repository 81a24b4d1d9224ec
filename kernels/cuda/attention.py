"""Numba-CUDA attention over the paged KV cache: decode and prefill, same API as :mod:`llmserve.kernels.cpu.attention`.

Both run :func:`llmserve.kernels.cuda.attention_kernels.attention_kernel` over *query
rows*: a decode row is a sequence with its context length; a prefill row is one
query token, whose context is every position up to and including its own (the
causal mask is just a per-row context length). Each row names the block table
row it reads.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from llmserve.kernels.cuda import attention_kernels as ak
from llmserve.kernels.attention_checks import check_context_attention_args, check_paged_attention_args
from llmserve.kernels.cuda._checks import check_attention_kernel_shape, check_dtypes, check_on_kernel_device
from llmserve.kernels.cuda._device import kernel_array, launch_on
from llmserve.kernels.validation import KVCacheDims

# vLLM's v2 choice: partitions of 512 positions, used when a long context
# would otherwise leave the GPU idle or overflow shared memory.
PARTITION_SIZE = 512
# Above this many positions the unpartitioned kernel's scores (4 bytes each)
# no longer fit the default 48 KiB of shared memory comfortably.
MAX_UNPARTITIONED_CONTEXT = 8192
# With more thread blocks than this (rows x heads), every SM of a large GPU
# already has several blocks to run, and partitioning only adds the reduce pass.
MIN_BLOCKS_WITHOUT_PARTITIONS = 512


def partition_size_for(num_rows: int, num_heads: int, longest: int, block_size: int) -> int:
    """Positions per partition for this launch, or 0 for the unpartitioned kernel.

    Partitioned when the longest context spans more than one partition and either
    exceeds ``MAX_UNPARTITIONED_CONTEXT`` or the grid has at most
    ``MIN_BLOCKS_WITHOUT_PARTITIONS`` thread blocks (long contexts, small batches).
    """
    # A partition holds whole KV blocks.
    size = -(-PARTITION_SIZE // block_size) * block_size
    if longest <= size:
        return 0
    if longest > MAX_UNPARTITIONED_CONTEXT or num_rows * num_heads <= MIN_BLOCKS_WITHOUT_PARTITIONS:
        return size
    return 0


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
    """Decode attention, one query per sequence; semantics of :func:`llmserve.kernels.cpu.paged_attention`.

    fp16 / bf16 / fp32 tensors (any mix), computed in float32; ``block_size``
    must divide 32. Long contexts with few sequences use the partitioned kernel
    (see :func:`partition_size_for`).
    """
    dims, longest = check_paged_attention_args(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, context_lens, block_size,
        max_context_len, alibi_slopes, sliding_window,
    )  # fmt: skip
    _check_kernel_inputs(out, query, key_cache, value_cache, dims)
    if query.shape[0] == 0:
        return
    row_seq = _rows(query.shape[0], query.device)
    _attend(
        out, query, key_cache, value_cache, dims, scale, block_tables, row_seq, context_lens, longest,
        alibi_slopes, sliding_window,
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _rows(num_rows: int, device: torch.device) -> torch.Tensor:
    """0 .. num_rows-1 (int32): a decode row's block-table row is its own index. Read-only, so shared."""
    return torch.arange(num_rows, dtype=torch.int32, device=device)


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
    """Prefill attention over the paged cache; semantics of :func:`llmserve.kernels.cpu.context_attention`.

    Query ``i`` of sequence ``b`` sits at position ``p = seq_lens[b] - q_len_b + i``
    and becomes one kernel row with context ``p + 1`` over block table row ``b``.
    """
    dims, _, lengths = check_context_attention_args(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, query_start_loc, seq_lens,
        block_size, alibi_slopes, sliding_window,
    )  # fmt: skip
    _check_kernel_inputs(out, query, key_cache, value_cache, dims)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    device = query.device
    starts = query_start_loc.long()
    # Row t belongs to sequence b with starts[b] <= t < starts[b + 1]; its position is
    # seq_lens[b] - (starts[b + 1] - t), so it attends to that position + 1 tokens.
    row_seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), starts[1:] - starts[:-1], output_size=num_tokens
    )
    row_ctx = seq_lens.long()[row_seq] - starts[row_seq + 1] + torch.arange(num_tokens, device=device) + 1
    _attend(
        out, query, key_cache, value_cache, dims, scale, block_tables, row_seq.to(torch.int32),
        row_ctx.to(torch.int32), max(lengths), alibi_slopes, sliding_window,
    )  # fmt: skip


@functools.cache
def _unused_arguments(device: torch.device) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per device, allocated once: the empty ALiBi slopes and the unpartitioned kernel's stand-in partials."""
    stats = torch.empty((1, 1, 1), dtype=torch.float32, device=device)
    return (torch.empty(0, dtype=torch.float32, device=device),
            (stats, torch.empty_like(stats), torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)))


def _check_kernel_inputs(
    out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, dims: KVCacheDims
) -> None:
    check_dtypes(out=out, query=query, key_cache=key_cache)
    check_on_kernel_device(query=query, key_cache=key_cache)
    check_attention_kernel_shape(dims)


def _attend(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    dims: KVCacheDims,
    scale: float,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_ctx: torch.Tensor,
    longest: int,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int | None,
) -> None:
    """Launch the attention kernel (and the partition reduce) over ``len(row_seq)`` query rows."""
    num_rows, num_heads, head_size = query.shape
    device = query.device
    partition_size = partition_size_for(num_rows, num_heads, longest, dims.block_size)
    kernel = ak.attention_kernel(head_size, dims.block_size, partition_size, query.dtype, key_cache.dtype, out.dtype)
    shared_bytes = 4 * ak.shared_floats(head_size, dims.block_size, longest, partition_size)
    no_slopes, stand_ins = _unused_arguments(device)
    slopes = no_slopes if alibi_slopes is None else alibi_slopes.to(device=device, dtype=torch.float32).contiguous()
    window = sliding_window or 0
    num_parts = -(-longest // partition_size) if partition_size else 1
    # float32 partials of the partitioned kernel; stand-ins the unpartitioned one never touches otherwise.
    if partition_size:
        stats_shape = (num_rows, num_heads, num_parts)
        exp_sums = torch.empty(stats_shape, dtype=torch.float32, device=device)
        max_logits = torch.empty(stats_shape, dtype=torch.float32, device=device)
        tmp_out = torch.empty((*stats_shape, head_size), dtype=torch.float32, device=device)
    else:
        exp_sums, max_logits, tmp_out = stand_ins
    partials = (kernel_array(exp_sums), kernel_array(max_logits), kernel_array(tmp_out))
    out_array = kernel_array(out)
    ctx_array = kernel_array(row_ctx)
    with launch_on(device) as stream:
        kernel[(num_rows, num_heads, num_parts), ak.NUM_THREADS, stream, shared_bytes](
            out_array, *partials, kernel_array(query), kernel_array(key_cache), kernel_array(value_cache),
            num_heads // dims.num_kv_heads, np.float32(scale), kernel_array(block_tables), kernel_array(row_seq),
            ctx_array, kernel_array(slopes), window,
        )  # fmt: skip
        if partition_size:
            reduce = ak.reduce_kernel(head_size, partition_size, out.dtype)
            reduce[(num_rows, num_heads), ak.NUM_THREADS, stream, 4 * num_parts](
                out_array, *partials, ctx_array, window
            )
