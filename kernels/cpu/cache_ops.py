"""CPU (torch) cache maintenance: write new tokens, copy blocks, swap blocks.

See :mod:`kernels.layout` for the cache layout and the meaning of a slot.
"""

from __future__ import annotations

import torch

from llmserve.kernels.cache_op_checks import check_copy_blocks_args, check_reshape_and_cache_args, check_swap_blocks_args


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key/value (``[T, num_kv_heads, head_size]``) into its cache slot.

    ``slot_mapping[t]`` is the slot of token ``t``; negative slots are padding
    and are skipped. Slots must be distinct (two tokens in one slot would race
    on a GPU, so the result is unspecified). Raises ValueError on bad shapes,
    dtypes, devices, or a slot past the end of the cache.
    """
    dims = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    if slot_mapping.numel() == 0:
        return

    # Drop padding tokens up front rather than clamping them to a dummy slot:
    # a dummy slot would be a real slot that some sequence owns. Most batches
    # have no padding, and then key/value are used as they are, uncopied.
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    block_ids = torch.div(slots, dims.block_size, rounding_mode="floor")
    offsets = slots - block_ids * dims.block_size

    # Two advanced indices separated by slices put the token dimension first:
    # key_cache[block_ids, :, :, offsets, :] has shape [T, kv_heads, D // x, x],
    # exactly key viewed with its head dimension split into 16-byte chunks.
    key_cache[block_ids, :, :, offsets, :] = key.reshape(-1, dims.num_kv_heads, dims.head_size // dims.x, dims.x)
    # value_cache[block_ids, :, :, offsets] has shape [T, kv_heads, D].
    value_cache[block_ids, :, :, offsets] = value


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every layer, copy block ``src`` to block ``dst`` for each ``(src, dst)`` row of ``block_mapping``.

    Used for copy-on-write of shared prefix blocks. All sources are read before
    any destination is written, and destinations must be distinct.
    """
    ids = check_copy_blocks_args(key_caches, value_caches, block_mapping)
    if ids is None:
        return
    src, dst = ids

    # Cache the index tensors per device: layers normally share one device.
    per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for key_cache, value_cache in zip(key_caches, value_caches):
        dev = key_cache.device
        if dev not in per_device:
            per_device[dev] = (src.to(dev), dst.to(dev))
        src_d, dst_d = per_device[dev]
        # index_select materialises the sources first, which gives the
        # read-all-then-write semantics promised above.
        key_cache.index_copy_(0, dst_d, key_cache.index_select(0, src_d))
        value_cache.index_copy_(0, dst_d, value_cache.index_select(0, src_d))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Set ``dst[d] = src[s]`` for each ``(s, d)`` row of ``block_mapping``.

    ``src`` and ``dst`` are one cache tensor each (one layer, key or value),
    with equal shapes except the number of blocks, and may live on different
    devices (swap out to / in from CPU memory). Destinations must be distinct.
    """
    ids = check_swap_blocks_args(src, dst, block_mapping)
    if ids is None:
        return
    src_ids, dst_ids = ids
    # Gather on the source device, move the compact batch of blocks once,
    # scatter on the destination device.
    blocks = src.index_select(0, src_ids.to(src.device)).to(dst.device)
    dst.index_copy_(0, dst_ids.to(dst.device), blocks)
