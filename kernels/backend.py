"""The kernel API every backend implements, and picking a backend for a device.

The model runner calls kernels only through a :class:`KernelBackend`, so the
CPU (torch) kernels and the Numba-CUDA kernels are interchangeable. The
Protocols below pin the shared signatures; each backend's docstrings give the
semantics (see :mod:`kernels.cpu`, :mod:`kernels.cuda`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch


class ReshapeAndCacheFn(Protocol):
    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...


class CopyBlocksFn(Protocol):
    def __call__(
        self,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        block_mapping: torch.Tensor,
    ) -> None: ...


class SwapBlocksFn(Protocol):
    def __call__(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None: ...


class PagedAttentionFn(Protocol):
    def __call__(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_kv_heads: int,
        scale: float,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        max_context_len: int,
        alibi_slopes: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> None: ...


class ContextAttentionFn(Protocol):
    def __call__(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_kv_heads: int,
        scale: float,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        alibi_slopes: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> None: ...


def _nothing_to_prepare(dtype: torch.dtype) -> None:
    del dtype


@dataclass(frozen=True)
class KernelBackend:
    """The five paged KV-cache kernels of one backend.

    ``prepare(dtype)``: compiles what caches of ``dtype`` need that the backend did not compile when it was built
    (the CPU kernels' bf16 variants); a worker calls it at its start, so that no step compiles.
    """

    name: str
    reshape_and_cache: ReshapeAndCacheFn
    copy_blocks: CopyBlocksFn
    swap_blocks: SwapBlocksFn
    paged_attention: PagedAttentionFn
    context_attention: ContextAttentionFn
    prepare: Callable[[torch.dtype], None] = _nothing_to_prepare


def _backend_of(name: str, module: ModuleType) -> KernelBackend:
    return KernelBackend(
        name=name,
        reshape_and_cache=module.reshape_and_cache,
        copy_blocks=module.copy_blocks,
        swap_blocks=module.swap_blocks,
        paged_attention=module.paged_attention,
        context_attention=module.context_attention,
    )


@functools.cache
def _cpu_backend() -> KernelBackend:
    # Imported here so that `kernels.backend` stays importable by the CUDA
    # backend without pulling in the CPU implementation. Importing the Numba
    # kernels compiles them or loads them from Numba's on-disk cache; doing it
    # here puts that cost at worker start (get_backend), not in the first step.
    from llmserve.kernels import cpu
    from llmserve.kernels.cpu import numba_attention, numba_cache_ops

    # Decode and prefill attention read the cache in place with Numba (faster than
    # gathering copies with torch ops: docs/kernels-cpu.md), and new keys/values are
    # copied into their slots by a Numba loop (the torch version rebuilds index tensors
    # per call); all fall back to the torch kernels for inputs they do not cover.
    return dataclasses.replace(_backend_of("cpu", cpu), paged_attention=numba_attention.paged_attention,
                               context_attention=numba_attention.context_attention,
                               reshape_and_cache=numba_cache_ops.reshape_and_cache, prepare=numba_attention.prepare)


@functools.cache
def _cuda_backend() -> KernelBackend:
    # Imported on first use: it imports numba.cuda, which CPU-only workers never need.
    from llmserve.kernels import cuda

    return _backend_of("cuda", cuda)


def get_backend(device: torch.device | str) -> KernelBackend:
    """Return the kernel backend for tensors on ``device`` (``"cpu"``, ``"cuda:0"``, ...).

    ``cpu`` gets the torch kernels with Numba attention and cache writes, ``cuda`` the Numba-CUDA kernels (whose
    swaps can also run per layer on a side stream: :class:`llmserve.kernels.cuda.LayerSwapper`).
    Raises NotImplementedError for other device types, ValueError for an
    unparsable device.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or device string, got {device!r}") from exc
    if dev.type == "cpu":
        return _cpu_backend()
    if dev.type == "cuda":
        return _cuda_backend()
    raise NotImplementedError(f"no kernel backend for device type {dev.type!r} (device {dev}); supported: cpu, cuda")
