"""The Numba reshape_and_cache writes exactly what the torch kernel writes, for every dtype and input layout."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from llmserve.kernels.cpu import cache_ops, numba_cache_ops
from llmserve.kernels.cpu.numba_cache_ops import write_token
from llmserve.kernels.layout import allocate_kv_cache

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    key_caches, value_caches = allocate_kv_cache(1, 40, 3, 32, 8, dtype, torch.device("cpu"))
    # NaN everywhere first: a slot the kernel should not touch stays NaN in both results.
    return key_caches[0].fill_(float("nan")), value_caches[0].fill_(float("nan"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 17, 300])
def test_writes_what_the_torch_kernel_writes(dtype: torch.dtype, tokens: int) -> None:
    torch.manual_seed(tokens)
    # Keys as a strided view of a wider row (the fused QKV output), values contiguous.
    key = torch.randn(tokens, 5 * 96)[:, 96:192].view(tokens, 3, 32).to(dtype) if dtype == torch.float32 else \
        torch.randn(tokens, 3, 32).to(dtype)
    value = torch.randn(tokens, 3, 32).to(dtype)
    slots = torch.randperm(40 * 8)[:tokens]
    slots[tokens // 2] = -1  # a padding token is skipped
    ours, theirs = _caches(dtype), _caches(dtype)
    assert numba_cache_ops.supports(key, value, *ours)
    numba_cache_ops.reshape_and_cache(key, value, ours[0], ours[1], slots)
    cache_ops.reshape_and_cache(key, value, theirs[0], theirs[1], slots)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_unsupported_inputs_go_to_the_torch_kernel_and_its_checks() -> None:
    key_cache, value_cache = _caches(torch.float32)
    key = torch.randn(2, 3, 64)[..., ::2]  # innermost stride 2: not covered
    assert not numba_cache_ops.supports(key, key, key_cache, value_cache)
    numba_cache_ops.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([0, 9]))
    assert torch.equal(value_cache[1, :, :, 1], key[1])


def test_a_slot_past_the_cache_is_refused() -> None:
    key_cache, value_cache = _caches(torch.float32)
    key = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="cache has only 320 slots"):
        numba_cache_ops.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([320]))


def test_a_later_call_with_a_smaller_cache_is_checked_again() -> None:
    # One step's slots serve every layer; the checks of the first call are reused only by calls whose
    # tensors are laid out alike, so a cache too small for the same slots is still refused.
    key_cache, value_cache = _caches(torch.float32)
    key = torch.randn(1, 3, 32)
    slots = torch.tensor([300])
    numba_cache_ops.reshape_and_cache(key, key, key_cache, value_cache, slots)
    assert torch.equal(value_cache[300 // 8, :, :, 300 % 8], key[0])
    with pytest.raises(ValueError, match="cache has only 240 slots"):
        numba_cache_ops.reshape_and_cache(key, key, key_cache[:30], value_cache[:30], slots)


@numba.njit
def _write_float32_tokens(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                          slots: np.ndarray) -> None:
    for t in range(key.shape[0]):
        write_token(key, value, key_cache, value_cache, slots, t)


def test_float32_tokens_into_a_bf16_cache_are_rounded_as_torch_rounds() -> None:
    """The compiled decode step's GEMV form writes float32 keys/values into bf16 caches: each element rounded to the nearest
    bf16, ties to even, as ``.to(torch.bfloat16)`` rounds (overflow to infinity, NaN kept NaN)."""
    torch.manual_seed(0)
    key, value = torch.randn(12, 3, 32) * 100, torch.randn(12, 3, 32)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0xFF7FFFFF, 0x007F8000, 0x00018000,
                            0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFF800001],
                           dtype=torch.int64).to(torch.int32).view(torch.float32)
    key[0, 0, :special.shape[0]] = special
    value[3, 2, -special.shape[0]:] = special
    slots = torch.randperm(40 * 8)[:12]
    ours, theirs = _caches(torch.bfloat16), _caches(torch.bfloat16)
    _write_float32_tokens(key.numpy(), value.numpy(), ours[0].view(torch.int16).numpy(),
                          ours[1].view(torch.int16).numpy(), slots.numpy())
    cache_ops.reshape_and_cache(key.to(torch.bfloat16), value.to(torch.bfloat16), *theirs, slots)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
