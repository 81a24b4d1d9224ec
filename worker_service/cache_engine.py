"""The paged KV cache: how many blocks fit, device blocks, host swap blocks, and the block operations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmserve.kernels import KernelBackend, allocate_kv_cache
from worker_service.model_loader import ModelShape
from worker_service.plan import check_pairs

if TYPE_CHECKING:
    from llmserve.kernels.cuda import LayerSwapper

_GIB = 1 << 30


class CacheSizeError(ValueError):
    """The configured memory cannot hold the cache the model needs."""


def block_bytes(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, keys and values."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_size * block_size * dtype.itemsize


@dataclass
class CacheSizing:
    """Block counts derived from memory budgets."""

    num_gpu_blocks: int
    num_cpu_blocks: int


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory measured around a profiling forward pass (see :mod:`worker_service.profiler`).

    total_bytes: the device's memory.
    peak_bytes: memory in use at the pass's peak, by everything on the device:
    this process's weights and activations, the CUDA context, other processes.
    num_tokens: tokens the pass computed (the step size the peak holds for).
    """

    total_bytes: int
    peak_bytes: int
    num_tokens: int


def gpu_cache_bytes(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache on a GPU, by vLLM's rule: ``utilization * total - peak``.

    Raises CacheSizeError when the model's peak alone reaches the allowed memory.
    """
    allowed = int(profile.total_bytes * gpu_memory_utilization)
    budget = allowed - profile.peak_bytes
    if budget <= 0:
        raise CacheSizeError(
            f"no GPU memory is left for the KV cache: a {profile.num_tokens}-token step peaks at "
            f"{profile.peak_bytes / _GIB:.2f} GiB (weights, activations, other processes) but "
            f"--gpu-memory-utilization={gpu_memory_utilization} allows {allowed / _GIB:.2f} GiB of the device's "
            f"{profile.total_bytes / _GIB:.2f} GiB; raise --gpu-memory-utilization, lower --max-model-len "
            "or free the GPU"
        )
    return budget


def size_cache(
    shape: ModelShape,
    block_size: int,
    dtype: torch.dtype,
    device_bytes: int,
    swap_bytes: int,
    max_model_len: int,
    num_gpu_blocks_override: int | None = None,
    memory_flag: str = "--kv-cache-memory",
) -> CacheSizing:
    """Number of device and host blocks; fails when one max-length sequence cannot fit.

    ``memory_flag`` names the flag that gives the device cache more memory, for the error.
    """
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
            f"give the cache more memory ({memory_flag}) or lower --max-model-len"
        )
    return CacheSizing(num_gpu_blocks=num_gpu, num_cpu_blocks=swap_bytes // per_block)


def check_host_memory(sizing: CacheSizing, per_block: int, cache_on_host: bool, available: int | None,
                      ranks: int = 1) -> None:
    """CacheSizeError when the blocks kept in host memory (a CPU worker's cache, any worker's swap space) are more
    than the host has left (``available``: shared/host_memory.py, None: unknown), measured after the model loaded.

    The cache is allocated as reserved pages that are only backed as requests fill them: too large a cache would
    start, and the worker would be killed by the OOM killer under load instead of refusing to start. For the same
    reason the ``ranks`` of a tensor-parallel worker (processes of one host, each with its own shard of every block)
    do not see each other's caches in ``available``: each counts all of them.
    """
    blocks = sizing.num_cpu_blocks + (sizing.num_gpu_blocks if cache_on_host else 0)
    if available is None or blocks * per_block * ranks <= available:
        return
    parts = ([f"the cache {sizing.num_gpu_blocks * per_block / _GIB:.2f} GiB"] if cache_on_host else []) + (
        [f"the swap space {sizing.num_cpu_blocks * per_block / _GIB:.2f} GiB"] if sizing.num_cpu_blocks else [])
    flags = (["--kv-cache-memory"] if cache_on_host else []) + (["--swap-space"] if sizing.num_cpu_blocks else [])
    each = f" on each of {ranks} tensor-parallel ranks" if ranks > 1 else ""
    raise CacheSizeError(
        f"the KV cache needs {blocks * per_block * ranks / _GIB:.2f} GiB of host memory ({' and '.join(parts)}{each}) "
        f"but only {available / _GIB:.2f} GiB is available with the model loaded (the machine's, or its container's "
        f"limit): lower {' or '.join(flags)}"
    )


class CacheEngine:
    """Owns the per-layer key/value caches on the device and in host memory.

    On a GPU, swaps run on a side stream (:class:`llmserve.kernels.cuda.LayerSwapper`)
    with one event per layer, so a step's swaps overlap with its forward pass
    and layer ``i`` waits (:meth:`wait_for_layer`) only for its own blocks. On a
    CPU, swaps are synchronous and waits return at once.
    """

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
        self.backend = backend
        self._swapper: LayerSwapper | None = None
        if device.type == "cuda":
            # Imported only on a GPU: it imports numba.cuda, which CPU workers never need.
            from llmserve.kernels.cuda import LayerSwapper  # noqa: PLC0415

            self._swapper = LayerSwapper(shape.num_layers, device)
        layout = (shape.num_kv_heads, shape.head_size, block_size, dtype)
        self.key_caches, self.value_caches = allocate_kv_cache(shape.num_layers, sizing.num_gpu_blocks, *layout,
                                                               device=device)
        self.cpu_key_caches: list[torch.Tensor] = []
        self.cpu_value_caches: list[torch.Tensor] = []
        if sizing.num_cpu_blocks:
            # Host blocks are pinned on a GPU so swaps run asynchronously.
            self.cpu_key_caches, self.cpu_value_caches = allocate_kv_cache(
                shape.num_layers, sizing.num_cpu_blocks, *layout, device=torch.device("cpu"),
                pin_memory=device.type == "cuda")

    def wait_for_layer(self, layer: int) -> None:
        """Make the device's current stream wait until ``layer``'s swapped blocks are in place."""
        if self._swapper is not None:
            self._swapper.wait(layer)

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
        check_pairs(what, pairs, n_src, n_dst)
        mapping = torch.tensor(pairs, dtype=torch.int64)
        if self._swapper is not None:
            # Queued behind this step's earlier swaps on the side stream: a swap-out's
            # freed blocks are read before a swap-in (or the forward pass) rewrites them.
            self._swapper.swap(src_k, src_v, dst_k, dst_v, mapping)
            return
        for layer in range(len(src_k)):
            self.backend.swap_blocks(src_k[layer], dst_k[layer], mapping)
            self.backend.swap_blocks(src_v[layer], dst_v[layer], mapping)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Device block copies (copy-on-write)."""
        if not pairs:
            return
        n = self.sizing.num_gpu_blocks
        check_pairs("copy", pairs, n, n)
        if self._swapper is not None:
            # One launch copies every layer, possibly blocks swapped in this step: wait for all swaps.
            self._swapper.wait_all()
        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.key_caches[0].device)
        self.backend.copy_blocks(self.key_caches, self.value_caches, mapping)
