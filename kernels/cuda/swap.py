"""Swapping cache blocks between GPU memory and (pinned) CPU memory.

A swap is a DMA transfer, not a kernel: like vLLM, each run of consecutive
blocks is one ``cudaMemcpyAsync`` (torch ``copy_(non_blocking=True)``), which
overlaps with compute when the CPU side is pinned.

:func:`swap_blocks` is the backend-API function: it copies on the current
stream. :class:`LayerSwapper` is what the worker uses to overlap swaps with the
model: it copies every layer on its own stream and records one event per
layer, so layer ``i`` of the model waits only for layer ``i``'s blocks.
Without a GPU (CPU caches, the simulator) copies are synchronous and waits are no-ops.
"""

from __future__ import annotations

import torch

from llmserve.kernels.cache_op_checks import check_swap_blocks_args


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Set ``dst[d] = src[s]`` for each ``(s, d)`` row; semantics of :func:`llmserve.kernels.cpu.swap_blocks`."""
    ids = check_swap_blocks_args(src, dst, block_mapping)
    if ids is None:
        return
    src_ids, dst_ids = ids
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        # Within one buffer a later copy could read a block an earlier one wrote: stage the sources.
        dst.index_copy_(0, dst_ids.to(dst.device), src.index_select(0, src_ids.to(src.device)))
        return
    for s, d, n in _runs(block_mapping.tolist()):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)


def _runs(pairs: list[list[int]]) -> list[tuple[int, int, int]]:
    """Group ``(src, dst)`` pairs into ``(src, dst, count)`` runs of consecutive blocks on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class LayerSwapper:
    """Swaps every layer's key and value blocks on a dedicated stream, with one event per layer.

    Usage in the worker::

        swapper = LayerSwapper(num_layers, device)
        swapper.swap(cpu_key_caches, cpu_value_caches, gpu_key_caches, gpu_value_caches, mapping)  # swap in
        ...
        swapper.wait(layer)   # in layer `layer`'s forward, before it reads its cache

    ``device`` is the GPU side of the swaps. On a CPU device there is no stream:
    :meth:`swap` copies synchronously and :meth:`wait` returns at once.
    """

    def __init__(self, num_layers: int, device: torch.device | str) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.device = torch.device(device)
        self.num_layers = num_layers
        on_gpu = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if on_gpu else None
        self._events = [torch.cuda.Event() for _ in range(num_layers)] if on_gpu else []

    def swap(
        self,
        src_key_caches: list[torch.Tensor],
        src_value_caches: list[torch.Tensor],
        dst_key_caches: list[torch.Tensor],
        dst_value_caches: list[torch.Tensor],
        block_mapping: torch.Tensor,
    ) -> None:
        """Copy blocks ``src -> dst`` of every layer, recording layer ``i``'s event after its copies."""
        lists = (src_key_caches, src_value_caches, dst_key_caches, dst_value_caches)
        if any(len(caches) != self.num_layers for caches in lists):
            raise ValueError(
                f"each cache list must have num_layers={self.num_layers} tensors, got {[len(c) for c in lists]}"
            )
        if self._stream is None:
            for layer in range(self.num_layers):
                swap_blocks(src_key_caches[layer], dst_key_caches[layer], block_mapping)
                swap_blocks(src_value_caches[layer], dst_value_caches[layer], block_mapping)
            return
        # The swap reads/writes caches that kernels queued on the model's stream may still be using.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for layer in range(self.num_layers):
                swap_blocks(src_key_caches[layer], dst_key_caches[layer], block_mapping)
                swap_blocks(src_value_caches[layer], dst_value_caches[layer], block_mapping)
                self._events[layer].record(self._stream)

    def wait(self, layer: int) -> None:
        """Make the current stream wait until ``layer``'s swapped blocks have arrived."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._events[layer])

    def wait_all(self) -> None:
        """Make the current stream wait for every queued swap (before work that touches every layer's blocks)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def synchronize(self) -> None:
        """Block the host until every queued swap has finished (before reading swapped-out CPU blocks)."""
        if self._stream is not None:
            self._stream.synchronize()
