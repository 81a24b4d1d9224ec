"""Argument checks shared by all kernel backends.

Kernels are called with tensors built far away (scheduler metadata, model
activations), so a wrong shape must fail loudly with the argument's name
instead of silently reading another sequence's cache. Checks here look only at
shapes, dtypes and devices (no data), so they cost nothing on a GPU; checks
that read data live in the backends, where their cost is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.layout import kv_pack_factor


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


def check_attention_common(
    *,
    out: object,
    query: object,
    key_cache: object,
    value_cache: object,
    num_kv_heads: object,
    scale: object,
    block_size: object,
    alibi_slopes: object,
    sliding_window: object,
) -> KVCacheDims:
    """Checks shared by decode and prefill attention; returns the cache sizes."""
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
    return dims
