"""Paged KV-cache layout (vLLM's), shared by every kernel backend.

Each layer owns one key cache and one value cache. Both are split into
fixed-size *blocks* of ``block_size`` token slots; a sequence's tokens live in
whichever physical blocks its block table names, in logical order.

Key cache, one layer::

    key_cache[num_blocks, num_kv_heads, head_size // x, block_size, x]

    x = 16 // element_size    (fp32 -> 4, fp16/bf16 -> 8): one 16-byte chunk

    block b, kv head h:
                       offset in block (token) ->
                       0          1          ...  block_size-1
    d // x = 0       [ x elems ][ x elems ]  ...  [ x elems ]   dims 0 .. x-1
    d // x = 1       [ x elems ][ x elems ]  ...  [ x elems ]   dims x .. 2x-1
      ...
    d // x = D/x-1   [ x elems ][ x elems ]  ...  [ x elems ]   dims D-x .. D-1

    element (token at offset o, dim d) = key_cache[b, h, d // x, o, d % x]

The innermost ``x`` elements are 16 contiguous bytes, so a GPU thread group
reading one head dimension chunk for consecutive tokens issues 16-byte loads.

Value cache, one layer (no packing; tokens are innermost, which suits the
probability-weighted sum over tokens)::

    value_cache[num_blocks, num_kv_heads, head_size, block_size]

    element (token at offset o, dim d) = value_cache[b, h, d, o]

Slot mapping: a *slot* is a flat token address across all blocks::

    slot = block_id * block_size + offset_in_block

    block_size = 4, block table of one sequence = [7, 2, 5]

    logical pos:  0  1  2  3 | 4  5  6  7 | 8  9
    phys block:   7  7  7  7 | 2  2  2  2 | 5  5
    slot:        28 29 30 31 | 8  9 10 11 |20 21

A negative slot marks a padding token that must not be written.
"""

from __future__ import annotations

import torch

# Bytes per innermost key-cache chunk; x = _KEY_CHUNK_BYTES // element_size.
_KEY_CHUNK_BYTES = 16


def kv_pack_factor(dtype: torch.dtype) -> int:
    """Return ``x``, the number of key elements packed in the innermost dimension.

    ``x = 16 // element_size``: 4 for float32, 8 for float16/bfloat16.
    Raises ValueError for non-floating dtypes or element sizes that do not
    divide 16 bytes.
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    itemsize = dtype.itemsize
    if _KEY_CHUNK_BYTES % itemsize != 0:
        raise ValueError(f"dtype element size must divide {_KEY_CHUNK_BYTES} bytes, got {dtype} ({itemsize} bytes)")
    return _KEY_CHUNK_BYTES // itemsize


def _check_dims(num_blocks: int, num_kv_heads: int, head_size: int, block_size: int) -> None:
    for name, value in (
        ("num_blocks", num_blocks),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
        ("block_size", block_size),
    ):
        # bool is an int subclass; True as a size is always a bug.
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def key_cache_shape(
    num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's key cache: ``(num_blocks, num_kv_heads, head_size // x, block_size, x)``.

    Raises ValueError if a size is not a positive int or ``head_size`` is not a
    multiple of ``x = kv_pack_factor(dtype)``.
    """
    _check_dims(num_blocks, num_kv_heads, head_size, block_size)
    x = kv_pack_factor(dtype)
    if head_size % x != 0:
        raise ValueError(f"head_size must be a multiple of x={x} for {dtype}, got {head_size}")
    return (num_blocks, num_kv_heads, head_size // x, block_size, x)


def value_cache_shape(
    num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype
) -> tuple[int, int, int, int]:
    """Shape of one layer's value cache: ``(num_blocks, num_kv_heads, head_size, block_size)``.

    Takes ``dtype`` (and validates ``head_size`` against it) so that key and
    value shapes are always derived from the same, mutually valid arguments.
    """
    key_cache_shape(num_blocks, num_kv_heads, head_size, block_size, dtype)
    return (num_blocks, num_kv_heads, head_size, block_size)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Allocate zeroed key and value caches for ``num_layers`` layers.

    Returns ``(key_caches, value_caches)``, one tensor per layer each.
    ``pin_memory`` (page-locked host memory, for fast async GPU<->CPU swaps)
    is only valid for a CPU device.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    k_shape = key_cache_shape(num_blocks, num_kv_heads, head_size, block_size, dtype)
    v_shape = value_cache_shape(num_blocks, num_kv_heads, head_size, block_size, dtype)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or device string, got {device!r}") from exc
    if pin_memory and dev.type != "cpu":
        raise ValueError(f"pin_memory=True requires a cpu device, got device={dev}")
    # Zeros, not empty: stale NaNs in never-written slots would otherwise leak
    # through 0 * NaN in kernels that touch whole blocks. One allocation per kind, every layer a view of it:
    # a kernel that runs all layers in one call takes the stack as one array (stacked_layers).
    keys = torch.zeros((num_layers, *k_shape), dtype=dtype, device=dev, pin_memory=pin_memory)
    values = torch.zeros((num_layers, *v_shape), dtype=dtype, device=dev, pin_memory=pin_memory)
    return list(keys.unbind(0)), list(values.unbind(0))


def stacked_layers(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """``[num_layers, ...]``: the per-layer caches as one tensor, when they are consecutive, equally shaped,
    contiguous slices of one allocation (as ``allocate_kv_cache`` makes them); None otherwise."""
    first = caches[0]
    if not first.is_contiguous():
        return None
    step = first.numel() * first.element_size()
    storage = first.untyped_storage().data_ptr()
    for i, cache in enumerate(caches):
        if (cache.untyped_storage().data_ptr() != storage or cache.data_ptr() != first.data_ptr() + i * step
                or cache.shape != first.shape or cache.dtype != first.dtype or not cache.is_contiguous()):
            return None
    return first.as_strided((len(caches), *first.shape), (first.numel(), *first.stride()))
