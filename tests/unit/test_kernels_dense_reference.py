"""The vectorized references (tests/kernels_dense_reference.py) equal the slow per-position ones.

The GPU kernel tests at serving shapes compare against the vectorized references; this keeps those
anchored to the layout definition that the slow references spell out position by position.
"""

from __future__ import annotations

import pytest
import torch

from llmserve import kernels
from tests import kernels_dense_reference as dense
from tests.kernel_cases import PagedCache, alibi_slopes_for
from tests.kernels_reference import ref_context_attention, ref_paged_attention, ref_reshape_and_cache

# (dtype, num_heads, num_kv_heads, head_size, block_size, use_alibi, sliding_window)
CASES = [
    (torch.float32, 4, 2, 64, 8, False, None),
    (torch.float16, 6, 2, 32, 16, True, None),
    (torch.bfloat16, 2, 2, 80, 4, False, 5),
    (torch.float32, 3, 1, 128, 32, True, 9),
]


def test_write_kv_equals_the_slow_writer_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(1)
    sizes = (6, 2, 64, 8, torch.bfloat16)
    caches = [torch.randn(kernels.key_cache_shape(*sizes), generator=gen).bfloat16(),
              torch.randn(kernels.value_cache_shape(*sizes), generator=gen).bfloat16()]
    expected = [c.clone() for c in caches]
    slots = torch.randperm(48, generator=gen)[:20]
    slots[[3, 11]] = -1
    kv = torch.randn(20, 2, 2, 64, generator=gen).bfloat16()
    ref_reshape_and_cache(kv[:, 0], kv[:, 1], *expected, slots)
    dense.write_kv(kv[:, 0], kv[:, 1], *caches, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}-d{c[3]}-bs{c[4]}")
def test_dense_paged_attention_equals_the_slow_reference(case: tuple) -> None:
    dtype, heads, kv_heads, head_size, block_size, alibi, window = case
    gen = torch.Generator().manual_seed(2)
    lens = [0, 1, block_size, block_size + 3, 37]
    cache = PagedCache(lens, kv_heads, head_size, block_size, dtype, gen)
    query = torch.randn(len(lens), heads, head_size, generator=gen).to(dtype)
    slopes = alibi_slopes_for(heads) if alibi else None
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, torch.tensor(lens), 0.3, slopes, window)
    expected, actual = ref_paged_attention(*args), dense.paged_attention(*args)
    assert torch.allclose(actual, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(actual[0], torch.zeros_like(actual[0]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}-d{c[3]}-bs{c[4]}")
def test_dense_context_attention_equals_the_slow_reference(case: tuple) -> None:
    dtype, heads, kv_heads, head_size, block_size, alibi, window = case
    gen = torch.Generator().manual_seed(3)
    seqs = [(11, 3), (1, 1), (20, 20), (5, 0), (9, 1)]  # (seq_len, q_len): the q_len newest are queries
    cache = PagedCache([n for n, _ in seqs], kv_heads, head_size, block_size, dtype, gen, dense=True)
    starts = torch.tensor([0] + torch.tensor([q for _, q in seqs]).cumsum(0).tolist())
    query = torch.randn(int(starts[-1]), heads, head_size, generator=gen).to(dtype)
    slopes = alibi_slopes_for(heads) if alibi else None
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, starts,
            torch.tensor([n for n, _ in seqs]), 0.2, slopes, window)
    assert torch.allclose(dense.context_attention(*args), ref_context_attention(*args), rtol=1e-12, atol=1e-12)
