"""Argument checks shared by all kernel backends: the building blocks.

Kernels are called with tensors built far away (scheduler metadata, model
activations), so a wrong shape must fail loudly with the argument's name
instead of silently reading another sequence's cache. Every backend runs the
same checks (here, :mod:`kernels.attention_checks` and
:mod:`kernels.cache_op_checks`), so both reject the same inputs with the same
messages. Most look only at shapes, dtypes and devices; the few that read data
(block ids, context lengths) read back one small result per call, which on a
GPU is one synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels.layout import kv_pack_factor


@dataclass(frozen=True)
class KVCacheDims:
    """Sizes of one layer's paged KV cache, read off the tensors."""

    num_blocks: int
    num_kv_heads: int
    head_size: int
    block_size: int
    x: int


def check_tensor(name: str, value: object, ndim: int) -> torch.Tensor:
    """Raise ValueError unless ``value`` is a tensor with ``ndim`` dimensions; return it."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def check_int_tensor(name: str, value: object, ndim: int) -> torch.Tensor:
    """Like :func:`check_tensor`, and the dtype must be an integer type (int32 or int64)."""
    tensor = check_tensor(name, value, ndim)
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    return tensor


def check_positive_int(name: str, value: object) -> int:
    """Raise ValueError unless ``value`` is an int >= 1 (bool rejected); return it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all given tensors are on one device."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")


def check_kv_cache_pair(key_cache: object, value_cache: object) -> KVCacheDims:
    """Validate one layer's key/value caches against the layout; return their sizes."""
    key_cache = check_tensor("key_cache", key_cache, 5)
    value_cache = check_tensor("value_cache", value_cache, 4)
    num_blocks, num_kv_heads, d_over_x, block_size, x = key_cache.shape
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}")
    expected_x = kv_pack_factor(key_cache.dtype)
    if x != expected_x:
        raise ValueError(
            f"key_cache last dimension must be x={expected_x} for {key_cache.dtype}, got shape {tuple(key_cache.shape)}"
        )
    head_size = d_over_x * x
    expected_value = (num_blocks, num_kv_heads, head_size, block_size)
    if tuple(value_cache.shape) != expected_value:
        raise ValueError(
            f"value_cache shape must be {expected_value} to match key_cache {tuple(key_cache.shape)}, "
            f"got {tuple(value_cache.shape)}"
        )
    check_same_device(key_cache=key_cache, value_cache=value_cache)
    return KVCacheDims(num_blocks, num_kv_heads, head_size, block_size, x)


def check_block_mapping(name: str, value: object) -> torch.Tensor:
    """Raise ValueError unless ``value`` is an integer ``[num_pairs, 2]`` tensor of (src, dst) pairs."""
    mapping = check_int_tensor(name, value, 2)
    if mapping.shape[1] != 2:
        raise ValueError(f"{name} must have shape [num_pairs, 2], got {tuple(mapping.shape)}")
    return mapping


def check_block_ids(name: str, block_ids: torch.Tensor, num_blocks: int) -> None:
    """Raise ValueError (naming ``name``) unless every id is in ``[0, num_blocks)``."""
    if block_ids.numel():
        low, high = (int(v) for v in torch.aminmax(block_ids))
        check_block_id_range(name, low, high, num_blocks)


def check_block_id_range(name: str, low: int, high: int, num_blocks: int) -> None:
    """Raise ValueError unless ids whose minimum is ``low`` and maximum ``high`` are in ``[0, num_blocks)``."""
    if low < 0 or high >= num_blocks:
        raise ValueError(f"{name} has block ids in [{low}, {high}], outside [0, {num_blocks})")


def check_distinct(name: str, ids: torch.Tensor) -> None:
    """Raise ValueError if ``ids`` repeats a value (two copies into one block would race on a GPU)."""
    if ids.numel() != torch.unique(ids).numel():
        raise ValueError(f"{name} has repeated destination blocks: {ids.tolist()}")
