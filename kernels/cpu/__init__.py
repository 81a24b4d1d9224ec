"""CPU kernel backend: the paged KV-cache kernels written with torch ops."""

from llmserve.kernels.cpu.attention import context_attention, paged_attention
from llmserve.kernels.cpu.cache_ops import copy_blocks, reshape_and_cache, swap_blocks

__all__ = [
    "context_attention",
    "copy_blocks",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]
