"""Argument checks of the CUDA backend beyond :mod:`kernels.validation`.

They mirror the CPU kernels' checks (same conditions, ValueError naming the
argument) so that both backends reject the same inputs. Checks that read data
(context lengths, block ids) gather what they need on the device and read it
back in one transfer: one synchronization per call.
"""

from __future__ import annotations

import torch

from kernels.cuda._device import check_kernel_device
from kernels.cuda._dtypes import SUPPORTED_DTYPES
from kernels.validation import KVCacheDims, check_int_tensor, check_same_device

_WARP_SIZE = 32


def check_dtypes(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is fp16, bf16 or fp32."""
    for name, tensor in tensors.items():
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {tensor.dtype} is not supported by the CUDA kernels (fp16, bf16, fp32)")


def check_attention_kernel_shape(dims: KVCacheDims) -> None:
    """Raise ValueError for a block size the attention kernels' thread layout cannot handle."""
    # One thread group scores one token of a block; the groups of a warp cover
    # a whole block, so the block size must divide the warp size.
    if _WARP_SIZE % dims.block_size != 0:
        raise ValueError(f"block_size must divide {_WARP_SIZE} for the CUDA attention kernels, got {dims.block_size}")


def check_decode_metadata(
    query: torch.Tensor,
    block_tables: object,
    context_lens: object,
    max_context_len: object,
    dims: KVCacheDims,
    sliding_window: int | None,
) -> int | None:
    """Validate decode metadata like the CPU kernel; return the longest context, or None for an empty batch."""
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
        return None

    # Only the block table entries the kernel reads must be valid: those from
    # the first block of the sliding window to the last block of the context.
    ctx = context_lens.long()
    block_size = dims.block_size
    column = torch.arange(block_tables.shape[1], device=ctx.device)
    first = torch.zeros_like(ctx) if sliding_window is None else (ctx - sliding_window).clamp_min(0) // block_size
    read = (column >= first[:, None]) & (column < (ctx[:, None] + block_size - 1) // block_size)
    # A zero (always in range) stands in for unread entries and for an empty table.
    ids = torch.nn.functional.pad(torch.where(read, block_tables.long(), 0).flatten(), (0, 1))
    shortest, longest, low, high = torch.stack([ctx.min(), ctx.max(), ids.min(), ids.max()]).tolist()

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
    _check_block_id_range("block_tables (used entries)", low, high, dims.num_blocks)
    return longest


def check_prefill_metadata(
    query: torch.Tensor,
    block_tables: object,
    query_start_loc: object,
    seq_lens: object,
    dims: KVCacheDims,
) -> list[int]:
    """Validate prefill metadata like the CPU kernel; return ``seq_lens`` as a list."""
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

    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
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
        needed = (seq_lens.long() + dims.block_size - 1) // dims.block_size
        read = torch.arange(block_tables.shape[1], device=needed.device) < needed[:, None]
        ids = torch.nn.functional.pad(torch.where(read, block_tables.long(), 0).flatten(), (0, 1))
        low, high = torch.stack([ids.min(), ids.max()]).tolist()
        _check_block_id_range("block_tables (used entries)", low, high, dims.num_blocks)
    return lengths


def check_block_ids(name: str, block_ids: torch.Tensor, num_blocks: int) -> None:
    """Raise ValueError (naming ``name``) unless every id is in ``[0, num_blocks)``."""
    if block_ids.numel():
        low, high = (int(v) for v in torch.aminmax(block_ids))
        _check_block_id_range(name, low, high, num_blocks)


def check_distinct(name: str, ids: torch.Tensor) -> None:
    """Raise ValueError if ``ids`` repeats a value (two copies into one block would race)."""
    if ids.numel() != torch.unique(ids).numel():
        raise ValueError(f"{name} has repeated destination blocks: {ids.tolist()}")


def check_on_kernel_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is on a device the kernels run on."""
    for name, tensor in tensors.items():
        check_kernel_device(name, tensor)


def _check_block_id_range(name: str, low: int, high: int, num_blocks: int) -> None:
    if low < 0 or high >= num_blocks:
        raise ValueError(f"{name} has block ids in [{low}, {high}], outside [0, {num_blocks})")
