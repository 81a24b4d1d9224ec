"""CPU attention with Numba, decode and prefill: the paged cache read in place, no gathered copies.

Same signatures and semantics as :func:`llmserve.kernels.cpu.attention.paged_attention` and
:func:`llmserve.kernels.cpu.attention.context_attention` (the torch twins), which stay the
fallback for what these kernels do not cover: float16 and float64 caches, caches
that are not contiguous, a query whose dtype is not the cache's, tensors off the
CPU, and (prefill) block sizes that are not a multiple of 4. float32 caches are
read as they are; bf16 caches through an int16 view, widened to float32 in the
kernel (exactly: bf16 is a float32's top half). Arithmetic is float32, as in
the torch kernel for these dtypes. float16 is left to the torch kernel because
widening it by bit manipulation (subnormals, infinities) is not worth a third
compiled variant for a dtype CPU workers do not pick by default.

Importing this module compiles the kernels for float32 caches or loads them from Numba's cache
(see :mod:`llmserve.kernels.cpu._numba_decode`, :mod:`llmserve.kernels.cpu._numba_prefill`); ``prepare`` does
the same for bf16 caches, at the start of a worker that has them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numba
import numpy as np
import torch

from llmserve.kernels.attention_checks import check_context_attention_args, check_paged_attention_args
from llmserve.kernels.cpu import attention as torch_attention
from llmserve.kernels.cpu._numba_decode import BF16_SIGNATURES as DECODE_BF16
from llmserve.kernels.cpu._numba_decode import decode_attention
from llmserve.kernels.cpu._numba_prefill import BF16_SIGNATURES as PREFILL_BF16
from llmserve.kernels.cpu._numba_prefill import context_attention as prefill_attention
from llmserve.kernels.cpu._numba_prefill import plan_tiles
from llmserve.kernels.cpu._numba_variants import require
from llmserve.kernels.cpu.numpy_views import numpy_view
from llmserve.kernels.metadata_memo import arguments_layout, reduce_once

T = TypeVar("T")

# Cache dtypes the Numba kernel reads, and the dtype it sees each one as.
_KERNEL_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.int16}
# The kernels' slopes argument without ALiBi.
_NO_SLOPES = np.empty(0, dtype=np.float32)
# Multiply-adds (query heads x context tokens x head size) each thread must have before a call runs on
# more than one, ~35 us of kernel time on one core. Every parallel call wakes the OpenMP team and ends on a
# barrier: microseconds on an idle machine, up to a scheduler time slice on a busy one. Measured on 2 cores:
# 115K multiply-adds (SmolLM2, 4 sequences of 50 tokens) take 125 us on one thread and 67 us on two when
# idle; the tiny test model's decode step (17K, ~20 us) gains nothing from a second thread, and under
# load two threads took milliseconds.
_MIN_WORK_PER_THREAD = 1 << 15


def kernel_threads(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, max_context_len: int) -> int:
    """Threads for one decode call: what the work fills, at most torch's thread count (the worker's --num-threads).

    Each work item (a sequence, or one KV head of it) is computed the same way on any thread, and each query
    head the same way in either kind of item, so the result does not depend on the count.
    """
    return _threads_for(num_seqs * num_heads * max_context_len * head_size, num_seqs * num_kv_heads)


def _threads_for(work: int, items: int) -> int:
    """Threads for ``work`` multiply-adds in ``items`` independent work items (see ``_MIN_WORK_PER_THREAD``)."""
    limit = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, items)
    return max(1, min(limit, work // _MIN_WORK_PER_THREAD))


def _use_threads(threads: int) -> None:
    # Numba's count is per calling thread; setting it costs more than reading it.
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the Numba kernels take these inputs (otherwise they run the torch kernels; prefill also
    needs a block size that is a multiple of 4)."""
    tensors = (query, key_cache, value_cache)
    # Anything else goes to the torch kernel, whose checks name what is wrong.
    return (
        all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)
        and key_cache.dtype in _KERNEL_VIEW
        and value_cache.dtype == key_cache.dtype
        and query.dtype == key_cache.dtype
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    )


def prepare(dtype: torch.dtype) -> None:
    """Compiles the kernels for caches of ``dtype``, or loads them from Numba's cache: at a worker's start, so that
    no step compiles (the float32 variants come with the import; the bf16 ones are compiled here, the first time).
    Other dtypes run the torch kernels and need nothing."""
    if dtype == torch.bfloat16:
        require(decode_attention, DECODE_BF16)
        require(prefill_attention, PREFILL_BF16)


def paged_attention(
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
) -> None:
    """Decode attention, as :func:`llmserve.kernels.cpu.attention.paged_attention`; writes ``out`` in place."""

    def validate() -> tuple[np.ndarray, np.ndarray, int] | None:
        if not supports(query, key_cache, value_cache):
            return None
        prepare(key_cache.dtype)  # a no-op once the worker's start has prepared its dtype
        # The checks also read back the block ids the kernel will read, which it then trusts.
        check_paged_attention_args(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, context_lens, block_size,
            max_context_len, alibi_slopes, sliding_window,
        )  # fmt: skip
        num_seqs, num_heads, head_size = query.shape
        threads = kernel_threads(num_seqs, num_heads, num_kv_heads, head_size, max_context_len)
        return (block_tables.to(torch.int32).contiguous().numpy(), context_lens.to(torch.int32).contiguous().numpy(),
                threads)

    prepared = _once_per_step("numba decode", (out, query, key_cache, value_cache), alibi_slopes, block_tables,
                              (context_lens,), (num_kv_heads, scale, block_size, max_context_len, sliding_window),
                              validate)
    if prepared is None:
        # The torch kernel validates the arguments itself, with the same checks.
        torch_attention.paged_attention(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, context_lens, block_size,
            max_context_len, alibi_slopes, sliding_window,
        )  # fmt: skip
        return
    tables, lens, threads = prepared
    _use_threads(threads)
    _run(decode_attention, out, _query_view(query), key_cache, value_cache, (tables, lens), alibi_slopes,
         (float(scale), sliding_window or 0, threads))  # fmt: skip


def _once_per_step(
    kind: str,
    tensors: tuple[object, ...],
    alibi_slopes: object,
    block_tables: object,
    metadata: tuple[object, ...],
    settings: tuple[object, ...],
    validate: Callable[[], T],
) -> T | None:
    """``validate()`` (which kernel takes the call, the checks, the converted metadata), computed once per step.

    Every layer of a step calls a kernel with the same metadata (``block_tables`` and ``metadata``) and tensors
    laid out alike: what ``validate`` decides holds for all of them, so it runs for the first layer only (~25 us
    of checks saved per call). The key holds the layout of ``tensors`` and ``alibi_slopes`` (all that
    ``supports`` reads but the types), the scalar ``settings`` and torch's thread count, which a kernel's thread
    count follows. None where an argument is not a tensor: the torch kernel then validates the call itself.
    """
    if not (all(isinstance(t, torch.Tensor) for t in (*tensors, block_tables, *metadata))
            and isinstance(alibi_slopes, torch.Tensor | None)):
        return None
    layout = (arguments_layout(*tensors, alibi_slopes), *settings, torch.get_num_threads())
    return reduce_once(block_tables, metadata, (kind, layout), validate)


def _run(
    kernel: Callable[..., None],
    out: torch.Tensor,
    query: np.ndarray,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: tuple[np.ndarray, ...],
    alibi_slopes: torch.Tensor | None,
    scalars: tuple[float | int, ...],
) -> None:
    """Call a Numba attention kernel: ``kernel(out, query, caches, *metadata, slopes, *scalars)``."""
    view = _KERNEL_VIEW[key_cache.dtype]
    # The kernels' scratch and arithmetic are float32; query/out conversions are small ([tokens, H, D]).
    result = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(out.shape)
    slopes = _NO_SLOPES if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous().numpy()
    kernel(
        result.numpy(),
        query,
        numpy_view(key_cache, view, flatten_from=3),  # [blocks, kv heads, D/x, BS * x]
        numpy_view(value_cache, view),
        *metadata,
        slopes,
        *scalars,
    )
    if result is not out:
        out.copy_(result)


def _query_view(query: torch.Tensor) -> np.ndarray:
    """The query as the kernels read it: a float32 one in place, strided (a view of the step's fused q/k/v rows),
    any other converted to a contiguous float32 copy."""
    if query.dtype == torch.float32 and query.stride(-1) == 1:
        return query.numpy()
    return query.to(torch.float32).contiguous().numpy()


def context_attention(
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
) -> None:
    """Prefill attention, as :func:`llmserve.kernels.cpu.attention.context_attention`; writes ``out`` in place."""
    num_heads, head_size = query.shape[1], query.shape[2]
    window = sliding_window or 0

    def validate() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
        # The kernel's loops take 4 slots of a block per pass (vLLM's block sizes are 8, 16, 32).
        if not supports(query, key_cache, value_cache) or key_cache.dim() != 5 or key_cache.shape[3] % 4:
            return None
        prepare(key_cache.dtype)
        # The checks also read back the block ids the kernel will read, which it then trusts.
        check_context_attention_args(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, query_start_loc, seq_lens,
            block_size, alibi_slopes, sliding_window,
        )  # fmt: skip
        starts = query_start_loc.to(torch.int32).contiguous().numpy()
        lengths = seq_lens.to(torch.int32).contiguous().numpy()
        tiles, size = plan_tiles(starts, lengths, num_kv_heads, num_heads // num_kv_heads, window)
        threads = _threads_for(size * head_size, tiles.shape[0])
        return block_tables.to(torch.int32).contiguous().numpy(), starts, lengths, tiles, threads

    prepared = _once_per_step("numba prefill", (out, query, key_cache, value_cache), alibi_slopes, block_tables,
                              (query_start_loc, seq_lens), (num_kv_heads, scale, block_size, window), validate)
    if prepared is None:
        # The torch kernel validates the arguments itself, with the same checks.
        torch_attention.context_attention(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, query_start_loc, seq_lens,
            block_size, alibi_slopes, sliding_window,
        )  # fmt: skip
        return
    tables, starts, lengths, tiles, threads = prepared
    if tiles.shape[0] == 0:  # no queries
        return
    _use_threads(threads)
    _run(prefill_attention, out, _query_view(query), key_cache, value_cache, (tables, starts, lengths, tiles),
         alibi_slopes, (float(scale), window, threads))  # fmt: skip
