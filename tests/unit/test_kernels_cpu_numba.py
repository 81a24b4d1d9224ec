"""What is particular to the Numba decode kernel: which inputs take it, and batches shaped like the worker's.

Its correctness cases are the torch twin's, in test_kernels_cpu.py (every decode
test there runs on both kernels).
"""

from __future__ import annotations

import numba
import pytest
import torch

from kernels.cpu import attention as cpu_attention
from kernels.cpu import numba_attention
from tests import kernel_cases
from tests.kernel_cases import TOLERANCE, PagedCache, alibi_slopes_for, nan_like


@pytest.fixture
def torch_calls(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Records the cache dtype of every call that falls back to the torch kernel."""
    calls: list[torch.dtype] = []
    torch_kernel = cpu_attention.paged_attention  # the patch below replaces this very attribute

    def spy(*args: object, **kwargs: object) -> None:
        calls.append(args[2].dtype)  # type: ignore[attr-defined]
        torch_kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(numba_attention.torch_attention, "paged_attention", spy)
    return calls


@pytest.mark.parametrize(
    "dtype, numba_runs",
    [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False), (torch.float64, False)],
)
def test_dtypes_pick_numba_or_the_torch_fallback(torch_calls: list, dtype: torch.dtype, numba_runs: bool) -> None:
    cfg = (dtype, 8, 2, 64, 16)
    err = kernel_cases.run_paged(numba_attention.paged_attention, cfg, [1, 16, 17, 40], True, 20, seed=21)
    assert err < TOLERANCE[dtype]
    assert torch_calls == ([] if numba_runs else [dtype])


def test_non_contiguous_cache_and_mixed_dtypes_fall_back(torch_calls: list) -> None:
    gen = torch.Generator().manual_seed(22)
    cache = PagedCache([5, 12], 2, 64, 8, torch.float32, gen)
    query = torch.randn(2, 4, 64, generator=gen)
    lens = torch.tensor([5, 12], dtype=torch.int32)
    # Every other kv head: a strided view of the same blocks.
    wide_keys = torch.stack([cache.key_cache, cache.key_cache], dim=2).flatten(1, 2)[:, ::2]
    args = (cache.value_cache, 2, 0.125, cache.block_tables, lens, 8, 12)
    numba_attention.paged_attention(nan_like(query), query, wide_keys, *args)
    numba_attention.paged_attention(nan_like(query), query.double(), cache.key_cache, *args)
    assert torch_calls == [torch.float32, torch.float32]


def test_worker_shaped_batch_matches_the_torch_twin() -> None:
    # SmolLM2's heads (9 query / 3 kv of 64, block 16) and a decode batch of 64 ragged
    # contexts: many parallel work items, partial first and last blocks under a window.
    gen = torch.Generator().manual_seed(23)
    lens_list = torch.randint(1, 300, (64,), generator=gen).tolist()
    cache = PagedCache(lens_list, 3, 64, 16, torch.float32, gen)
    query = torch.randn(64, 9, 64, generator=gen)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    for slopes, window in [(None, None), (alibi_slopes_for(9), 100)]:
        args = (cache.key_cache, cache.value_cache, 3, 0.125, cache.block_tables, lens, 16, 300, slopes, window)
        fast, twin = nan_like(query), nan_like(query)
        numba_attention.paged_attention(fast, query, *args)
        cpu_attention.paged_attention(twin, query, *args)
        torch.testing.assert_close(fast, twin, rtol=1e-5, atol=1e-5)


def test_kernel_threads_follow_torch_threads() -> None:
    # The worker's --num-threads sets torch's threads; the kernel must not use more.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        kernel_cases.run_paged(numba_attention.paged_attention, (torch.float32, 4, 2, 64, 8), [9], False, None, 24)
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
