"""Argument checks of the cache maintenance kernels, shared by every backend.

``reshape_and_cache``, ``copy_blocks`` and ``swap_blocks`` write into the
cache, so a bad slot or block id would corrupt another sequence's tokens:
every id is checked against the cache's size, and destinations must be
distinct (two copies into one block would race on a GPU; refusing is better
than picking a winner).
"""

from __future__ import annotations

import torch

from llmserve.kernels.metadata_memo import reduce_once
from llmserve.kernels.validation import (
    KVCacheDims,
    check_block_ids,
    check_block_mapping,
    check_distinct,
    check_int_tensor,
    check_kv_cache_pair,
    check_same_device,
    check_tensor,
)


def check_reshape_and_cache_args(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> KVCacheDims:
    """Validate ``reshape_and_cache``'s arguments, including every slot's upper bound; return the cache sizes."""
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
    if slot_mapping.numel():
        num_slots = dims.num_blocks * dims.block_size
        # Once per step, not per layer: the read-back is a GPU synchronization.
        max_slot = reduce_once(slot_mapping, (), "max", lambda: int(slot_mapping.max()))
        if max_slot >= num_slots:
            raise ValueError(f"slot_mapping has slot {max_slot} but the cache has only {num_slots} slots")
    return dims


def check_copy_blocks_args(
    key_caches: object, value_caches: object, block_mapping: object
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate ``copy_blocks``'s arguments; return the (src, dst) block ids as int64, or None when there is nothing to copy."""
    if not isinstance(key_caches, (list, tuple)) or not isinstance(value_caches, (list, tuple)):
        raise ValueError("key_caches and value_caches must be lists of tensors")
    if len(key_caches) != len(value_caches):
        raise ValueError(f"key_caches has {len(key_caches)} layers but value_caches has {len(value_caches)}")
    block_mapping = check_block_mapping("block_mapping", block_mapping)
    if block_mapping.shape[0] == 0 or len(key_caches) == 0:
        return None
    num_blocks = min(check_kv_cache_pair(k, v).num_blocks for k, v in zip(key_caches, value_caches))
    return _check_pairs(block_mapping, num_blocks, num_blocks)


def check_swap_blocks_args(src: object, dst: object, block_mapping: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate ``swap_blocks``'s arguments; return the (src, dst) block ids as int64, or None when there is nothing to swap."""
    src, dst = _check_cache_tensor("src", src), _check_cache_tensor("dst", dst)
    if tuple(src.shape[1:]) != tuple(dst.shape[1:]):
        raise ValueError(f"src block shape {tuple(src.shape[1:])} differs from dst block shape {tuple(dst.shape[1:])}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} differs from dst dtype {dst.dtype}")
    block_mapping = check_block_mapping("block_mapping", block_mapping)
    if block_mapping.shape[0] == 0:
        return None
    return _check_pairs(block_mapping, src.shape[0], dst.shape[0])


def _check_cache_tensor(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a cache tensor [num_blocks, ...], got {got}")
    return tensor


def _check_pairs(block_mapping: torch.Tensor, src_blocks: int, dst_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    check_block_ids("block_mapping[:, 0] (src)", src, src_blocks)
    check_block_ids("block_mapping[:, 1] (dst)", dst, dst_blocks)
    check_distinct("block_mapping[:, 1] (dst)", dst)
    return src, dst
