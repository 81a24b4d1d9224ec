"""Numba-CUDA cache maintenance: write new tokens into their slots, copy blocks.

Same API and semantics as :mod:`llmserve.kernels.cpu.cache_ops`. Both kernels move raw
element bits (int16 / int32 views), so one specialization serves every dtype
of a size and copies are exact. Slot arithmetic is pictured in :mod:`kernels.layout`.
"""

from __future__ import annotations

import torch
from numba import cuda

from llmserve.kernels.cache_op_checks import check_copy_blocks_args, check_reshape_and_cache_args
from llmserve.kernels.cuda._checks import check_on_kernel_device
from llmserve.kernels.cuda._device import bits_array, kernel_array, launch_on

_MAX_THREADS = 256
# Caches per copy_blocks launch. Each cache is a 1-D array argument of 56 bytes
# (pointer, sizes, stride), and kernel arguments are limited to 4 KiB: 64
# caches (32 layers' keys and values) take 3.5 KiB. Deeper models take a few launches.
_CACHES_PER_LAUNCH = 64


def _threads_for(elements: int) -> int:
    # Whole warps, enough for one pass over `elements` when that is small.
    return min(_MAX_THREADS, max(32, -(-elements // 32) * 32))


@cuda.jit
def _reshape_and_cache_kernel(key, value, key_cache, value_cache, slot_mapping):
    token = cuda.blockIdx.x
    slot = slot_mapping[token]
    if slot < 0:
        return  # padding
    block_size = key_cache.shape[3]
    x = key_cache.shape[4]
    block = slot // block_size
    offset = slot % block_size
    head_size = key.shape[2]
    for i in range(cuda.threadIdx.x, key.shape[1] * head_size, cuda.blockDim.x):
        head = i // head_size
        d = i % head_size
        key_cache[block, head, d // x, offset, d % x] = key[token, head, d]
        value_cache[block, head, d, offset] = value[token, head, d]


@cuda.jit
def _copy_blocks_kernel(caches, src_ids, dst_ids, block_numel):
    # caches: a tuple of flat caches; grid (pairs, caches).
    pair = cuda.blockIdx.x
    cache = caches[cuda.blockIdx.y]
    src = src_ids[pair] * block_numel
    dst = dst_ids[pair] * block_numel
    for i in range(cuda.threadIdx.x, block_numel, cuda.blockDim.x):
        cache[dst + i] = cache[src + i]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key/value into its cache slot; semantics of :func:`llmserve.kernels.cpu.reshape_and_cache`.

    One thread block per token; negative slots (padding) return at once.
    """
    dims = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    check_on_kernel_device(key_cache=key_cache)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    threads = _threads_for(dims.num_kv_heads * dims.head_size)
    with launch_on(key_cache.device) as stream:
        _reshape_and_cache_kernel[num_tokens, threads, stream](
            bits_array(key), bits_array(value), bits_array(key_cache), bits_array(value_cache),
            kernel_array(slot_mapping),
        )  # fmt: skip


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every layer, copy block ``src`` to ``dst`` for each ``(src, dst)`` row; see :func:`llmserve.kernels.cpu.copy_blocks`.

    One launch over (pairs x caches), for up to 32 layers. All sources are read
    before any destination is written: when a destination is also a source
    (copy-on-write never produces that), the copies go through torch's
    ``index_select`` / ``index_copy_`` instead, which stage the sources.
    """
    ids = check_copy_blocks_args(key_caches, value_caches, block_mapping)
    if ids is None:
        return
    src, dst = ids
    caches = [c for pair in zip(key_caches, value_caches) for c in pair]
    check_on_kernel_device(**{f"caches[{i}]": c for i, c in enumerate(caches)})

    first = caches[0]
    one_kernel = all(c.is_contiguous() and c.dtype == first.dtype and c.device == first.device for c in caches)
    if not one_kernel or bool(torch.isin(dst, src).any()):
        _copy_blocks_staged(caches, src, dst)
        return
    block_numel = first[0].numel()  # the same for key and value blocks
    src_ids = kernel_array(src.to(first.device))
    dst_ids = kernel_array(dst.to(first.device))
    flat = [bits_array(c.view(-1)) for c in caches]
    with launch_on(first.device) as stream:
        for start in range(0, len(flat), _CACHES_PER_LAUNCH):
            chunk = tuple(flat[start : start + _CACHES_PER_LAUNCH])
            _copy_blocks_kernel[(len(src), len(chunk)), _threads_for(block_numel), stream](
                chunk, src_ids, dst_ids, block_numel
            )


def _copy_blocks_staged(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    # index_select materialises every source before index_copy_ writes.
    for cache in caches:
        cache.index_copy_(0, dst.to(cache.device), cache.index_select(0, src.to(cache.device)))
