"""CPU (torch) cache maintenance: write new tokens, copy blocks, swap blocks.

See :mod:`kernels.layout` for the cache layout and the meaning of a slot.
"""

from __future__ import annotations

import torch

from kernels.cpu._block_gather import check_block_ids
from kernels.validation import (
    check_block_mapping,
    check_int_tensor,
    check_kv_cache_pair,
    check_same_device,
    check_tensor,
)


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
    dims = check_kv_cache_pair(key_cache, value_cache)
    key = check_tensor("key", key, 3)
    value = check_tensor("value", value, 3)
    slot_mapping = check_int_tensor("slot_mapping", slot_mapping, 1)
    expected = (slot_mapping.shape[0], dims.num_kv_heads, dims.head_size)
    if tuple(key.shape) != expected:
        raise ValueError(f"key shape must be {expected} (tokens, kv heads, head size), got {tuple(key.shape)}")
    if tuple(value.shape) != expected:
        raise ValueError(f"value shape must be {expected} (tokens, kv heads, head size), got {tuple(value.shape)}")
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        raise ValueError(f"key/value dtypes ({key.dtype}, {value.dtype}) must equal the cache dtype {key_cache.dtype}")
    check_same_device(key_cache=key_cache, key=key, value=value, slot_mapping=slot_mapping)
    if slot_mapping.numel() == 0:
        return

    num_slots = dims.num_blocks * dims.block_size
    max_slot = int(slot_mapping.max())
    if max_slot >= num_slots:
        raise ValueError(f"slot_mapping has slot {max_slot} but the cache has only {num_slots} slots")

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


def _check_distinct(name: str, ids: torch.Tensor) -> None:
    # Two copies into one block would race on a GPU; refuse rather than pick a winner.
    if ids.numel() != torch.unique(ids).numel():
        raise ValueError(f"{name} has repeated destination blocks: {ids.tolist()}")


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every layer, copy block ``src`` to block ``dst`` for each ``(src, dst)`` row of ``block_mapping``.

    Used for copy-on-write of shared prefix blocks. All sources are read before
    any destination is written, and destinations must be distinct.
    """
    if not isinstance(key_caches, (list, tuple)) or not isinstance(value_caches, (list, tuple)):
        raise ValueError("key_caches and value_caches must be lists of tensors")
    if len(key_caches) != len(value_caches):
        raise ValueError(f"key_caches has {len(key_caches)} layers but value_caches has {len(value_caches)}")
    block_mapping = check_block_mapping("block_mapping", block_mapping)
    if block_mapping.shape[0] == 0 or len(key_caches) == 0:
        return
    dims = [check_kv_cache_pair(k, v) for k, v in zip(key_caches, value_caches)]
    num_blocks = min(d.num_blocks for d in dims)
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    check_block_ids("block_mapping[:, 0] (src)", src, num_blocks)
    check_block_ids("block_mapping[:, 1] (dst)", dst, num_blocks)
    _check_distinct("block_mapping[:, 1] (dst)", dst)

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
    for name, tensor in (("src", src), ("dst", dst)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be a cache tensor [num_blocks, ...], got {got}")
    if tuple(src.shape[1:]) != tuple(dst.shape[1:]):
        raise ValueError(f"src block shape {tuple(src.shape[1:])} differs from dst block shape {tuple(dst.shape[1:])}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} differs from dst dtype {dst.dtype}")
    block_mapping = check_block_mapping("block_mapping", block_mapping)
    if block_mapping.shape[0] == 0:
        return
    src_ids = block_mapping[:, 0].long()
    dst_ids = block_mapping[:, 1].long()
    check_block_ids("block_mapping[:, 0] (src)", src_ids, src.shape[0])
    check_block_ids("block_mapping[:, 1] (dst)", dst_ids, dst.shape[0])
    _check_distinct("block_mapping[:, 1] (dst)", dst_ids)
    # Gather on the source device, move the compact batch of blocks once,
    # scatter on the destination device.
    blocks = src.index_select(0, src_ids.to(src.device)).to(dst.device)
    dst.index_copy_(0, dst_ids.to(dst.device), blocks)
