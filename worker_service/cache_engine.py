"""The paged KV cache: device blocks, host swap blocks, and the block operations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import KernelBackend, allocate_kv_cache
from worker_service.model_loader import ModelShape


class CacheSizeError(ValueError):
    """The configured memory cannot hold the cache the model needs."""


def block_bytes(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, keys and values."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_size * block_size * element


@dataclass
class CacheSizing:
    """Block counts derived from memory budgets."""

    num_gpu_blocks: int
    num_cpu_blocks: int


def size_cache(
    shape: ModelShape,
    block_size: int,
    dtype: torch.dtype,
    device_bytes: int,
    swap_bytes: int,
    max_model_len: int,
    num_gpu_blocks_override: int | None = None,
) -> CacheSizing:
    """Number of device and host blocks; fails when one max-length sequence cannot fit."""
    per_block = block_bytes(shape, block_size, dtype)
    num_gpu = num_gpu_blocks_override or device_bytes // per_block
    needed = -(-max_model_len // block_size)
    what = f"one sequence of max_model_len={max_model_len}"
    if shape.sliding_window is not None:
        # The scheduler cycles a sequence through a ring of blocks; the smallest covers the window
        # plus the block being written.
        ring = -(-shape.sliding_window // block_size) + 1
        if ring < needed:
            needed, what = ring, f"one sequence under the model's sliding window of {shape.sliding_window} tokens"
    if num_gpu < needed:
        raise CacheSizeError(
            f"the KV cache holds {num_gpu} blocks of {block_size} tokens ({num_gpu * block_size} tokens), "
            f"fewer than {what} needs ({needed} blocks); "
            "give the cache more memory (--kv-cache-memory) or lower --max-model-len"
        )
    return CacheSizing(num_gpu_blocks=num_gpu, num_cpu_blocks=swap_bytes // per_block)


class CacheEngine:
    """Owns the per-layer key/value caches on the device and in host memory."""

    def __init__(
        self,
        shape: ModelShape,
        sizing: CacheSizing,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: KernelBackend,
    ) -> None:
        self.block_size = block_size
        self.sizing = sizing
        self._backend = backend
        args = (shape.num_layers, shape.num_kv_heads, shape.head_size, block_size, dtype)
        self.key_caches, self.value_caches = allocate_kv_cache(
            args[0], sizing.num_gpu_blocks, *args[1:], device=device
        )
        # Host blocks are pinned on a GPU so swaps run asynchronously.
        pin = device.type == "cuda"
        self.cpu_key_caches: list[torch.Tensor] = []
        self.cpu_value_caches: list[torch.Tensor] = []
        if sizing.num_cpu_blocks:
            self.cpu_key_caches, self.cpu_value_caches = allocate_kv_cache(
                args[0], sizing.num_cpu_blocks, *args[1:], device=torch.device("cpu"), pin_memory=pin
            )

    def _check(self, pairs: list[tuple[int, int]], src_blocks: int, dst_blocks: int, what: str) -> None:
        for src, dst in pairs:
            if not (0 <= src < src_blocks and 0 <= dst < dst_blocks):
                raise ValueError(f"{what} pair ({src}, {dst}) is out of range ({src_blocks} -> {dst_blocks} blocks)")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host -> device block moves."""
        self._swap(pairs, self.cpu_key_caches, self.key_caches, self.cpu_value_caches, self.value_caches,
                   self.sizing.num_cpu_blocks, self.sizing.num_gpu_blocks, "swap_in")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device -> host block moves."""
        self._swap(pairs, self.key_caches, self.cpu_key_caches, self.value_caches, self.cpu_value_caches,
                   self.sizing.num_gpu_blocks, self.sizing.num_cpu_blocks, "swap_out")

    def _swap(self, pairs, src_k, dst_k, src_v, dst_v, n_src: int, n_dst: int, what: str) -> None:  # type: ignore[no-untyped-def]
        if not pairs:
            return
        self._check(pairs, n_src, n_dst, what)
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for layer in range(len(src_k)):
            self._backend.swap_blocks(src_k[layer], dst_k[layer], mapping)
            self._backend.swap_blocks(src_v[layer], dst_v[layer], mapping)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Device block copies (copy-on-write)."""
        if not pairs:
            return
        n = self.sizing.num_gpu_blocks
        self._check(pairs, n, n, "copy")
        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.key_caches[0].device)
        self._backend.copy_blocks(self.key_caches, self.value_caches, mapping)
