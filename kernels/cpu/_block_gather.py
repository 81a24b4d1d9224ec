"""Reading whole blocks out of the paged cache for the CPU attention kernels.

Gathering is the bulk of CPU attention's memory traffic, so these helpers are
about doing it in as few passes as possible, and about which gathered slots
may hold data that was never written (see :func:`unwritten_slots`).
"""

from __future__ import annotations

import torch


def compute_dtype_for(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype attention math runs in: float32 for half inputs, float64 if any input is float64."""
    result = torch.float32
    for dtype in dtypes:
        result = torch.promote_types(result, dtype)
    return result


def contiguous_as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous ``dtype`` copy of ``tensor`` (typically a permuted view)."""
    # One pass that both reorders (a permuted view) and converts the dtype;
    # `.to(dtype).contiguous()` would make two copies of the gathered cache.
    result = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
    result.copy_(tensor)
    return result


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` for an integer index tensor of any shape, as whole-block copies."""
    if cache.is_contiguous():
        # On a [num_blocks, block_numel] view index_select copies each block
        # with one memcpy; advanced indexing on the 5-D tensor goes element by
        # element and is several times slower.
        flat = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
        return flat.view(*block_ids.shape, *cache.shape[1:])
    return cache[block_ids]


def unwritten_slots(
    used: torch.Tensor, ctx: torch.Tensor, logical: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, gathered block, offset) indices of gathered slots that may never have been written.

    Those are the slots at or past the context's end in each sequence's last
    block, and the same slots in the unused entries when those read the last
    block too (contexts that fit in their first gathered block; empty contexts,
    where every slot counts). Everything else gathered is real token data.
    Assumes the caller pointed unused entries at the sequence's first gathered
    block, or at any block for an empty context.
    used, logical: ``[S, nblk]``; ctx: ``[S, 1]``.
    """
    num_gathered = used.shape[1]
    last = used.sum(dim=1, keepdim=True) - 1  # gathered index of the last used block; -1 if none
    last_start = (logical[:, :1] + last.clamp_min(0)) * block_size  # position of its first slot
    past_end = last_start + torch.arange(block_size, device=used.device) >= ctx  # [S, BS]
    block = torch.arange(num_gathered, device=used.device)
    holds_last = (block == last) | (~used & (last <= 0))  # [S, nblk]
    return torch.nonzero(holds_last[:, :, None] & past_end[:, None, :], as_tuple=True)

