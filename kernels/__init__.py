"""Paged KV-cache kernels (vLLM layout) behind one API shared by all backends.

Pick a backend for the device the caches live on::

    backend = kernels.get_backend(device)
    backend.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    backend.paged_attention(out, query, key_cache, value_cache, ...)

The package-level kernel functions are the CPU versions, for convenience.
The cache layout is described in :mod:`kernels.layout`.
"""

from llmserve.kernels.backend import KernelBackend, get_backend
from llmserve.kernels.cpu import context_attention, copy_blocks, paged_attention, reshape_and_cache, swap_blocks
from llmserve.kernels.layout import allocate_kv_cache, key_cache_shape, kv_pack_factor, value_cache_shape

__all__ = [
    "KernelBackend",
    "allocate_kv_cache",
    "context_attention",
    "copy_blocks",
    "get_backend",
    "key_cache_shape",
    "kv_pack_factor",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
    "value_cache_shape",
]
