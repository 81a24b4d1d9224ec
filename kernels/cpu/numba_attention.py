"""CPU decode attention with Numba: the paged cache read in place, no gathered copies.

Same signature and semantics as :func:`kernels.cpu.attention.paged_attention`
(the torch twin), which stays the fallback for what this kernel does not
cover: float16 and float64 caches, caches that are not contiguous, a query
whose dtype is not the cache's, and tensors off the CPU. float32 caches are
read as they are; bf16 caches through an int16 view, widened to float32 in the
kernel (exactly: bf16 is a float32's top half). Arithmetic is float32, as in
the torch kernel for these dtypes. float16 is left to the torch kernel because
widening it by bit manipulation (subnormals, infinities) is not worth a third
compiled variant for a dtype CPU workers do not pick by default.

Importing this module compiles the kernel or loads it from Numba's cache
(see :mod:`kernels.cpu._numba_decode`).
"""

from __future__ import annotations

import numba
import torch

from kernels.attention_checks import check_paged_attention_args
from kernels.cpu import attention as torch_attention
from kernels.cpu._numba_decode import decode_attention

# Cache dtypes the Numba kernel reads, and the dtype it sees each one as.
_KERNEL_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.int16}
# Multiply-adds (query heads x context tokens x head size) each thread must have before a call runs on
# more than one, ~35 us of kernel time on one core. Every parallel call wakes the OpenMP team and ends on a
# barrier: microseconds on an idle machine, up to a scheduler time slice on a busy one. Measured on 2 cores:
# 115K multiply-adds (SmolLM2, 4 sequences of 50 tokens) take 125 us on one thread and 67 us on two when
# idle; the tiny test model's decode step (17K, ~20 us) gains nothing from a second thread, and under
# load two threads took milliseconds.
_MIN_WORK_PER_THREAD = 1 << 15


def kernel_threads(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, max_context_len: int) -> int:
    """Threads for one call: what the work fills, at most torch's thread count (the worker's --num-threads).

    Each (sequence, KV head) work item is computed the same way on any thread, so the
    result does not depend on the count.
    """
    limit = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, num_seqs * num_kv_heads)
    work = num_seqs * num_heads * max_context_len * head_size
    return max(1, min(limit, work // _MIN_WORK_PER_THREAD))


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_attention` runs these inputs with Numba (otherwise it runs the torch kernel)."""
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
    """Decode attention, as :func:`kernels.cpu.attention.paged_attention`; writes ``out`` in place."""
    if not supports(query, key_cache, value_cache):
        # The torch kernel validates the arguments itself, with the same checks.
        torch_attention.paged_attention(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, context_lens, block_size,
            max_context_len, alibi_slopes, sliding_window,
        )  # fmt: skip
        return
    # The checks also read back the block ids the kernel will read, which it then trusts.
    check_paged_attention_args(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, context_lens, block_size,
        max_context_len, alibi_slopes, sliding_window,
    )  # fmt: skip
    view = _KERNEL_VIEW[key_cache.dtype]
    # The kernel's scratch and arithmetic are float32; query/out conversions are small ([S, H, D]).
    result = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(out.shape)
    slopes = torch.empty(0) if alibi_slopes is None else alibi_slopes
    num_seqs, num_heads, head_size = query.shape
    threads = kernel_threads(num_seqs, num_heads, num_kv_heads, head_size, max_context_len)
    # Numba's count is per calling thread; setting it costs more than reading it.
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    decode_attention(
        result.numpy(),
        query.to(torch.float32).contiguous().numpy(),
        key_cache.view(view).flatten(3).numpy(),  # [blocks, kv heads, D/x, BS * x]
        value_cache.view(view).numpy(),
        block_tables.to(torch.int32).contiguous().numpy(),
        context_lens.to(torch.int32).contiguous().numpy(),
        slopes.to(torch.float32).contiguous().numpy(),
        float(scale),
        sliding_window or 0,
    )
    if result is not out:
        out.copy_(result)
