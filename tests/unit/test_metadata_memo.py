"""Metadata reductions once per step (kernels/metadata_memo.py), and the checks that use them.

A model calls each kernel once per layer with the same metadata; the checks reduce it once and must
still see every change made with torch ops.
"""

from __future__ import annotations

import pytest
import torch

from llmserve import kernels
from llmserve.kernels.attention_checks import check_context_attention_args, check_paged_attention_args
from llmserve.kernels.cache_op_checks import check_reshape_and_cache_args
from llmserve.kernels.metadata_memo import reduce_once

NUM_BLOCKS, KV_HEADS, HEAD, BLOCK = 8, 2, 16, 4


class Counter:
    def __init__(self, value: object) -> None:
        self.calls = 0
        self.value = value

    def __call__(self) -> object:
        self.calls += 1
        return self.value


def test_same_unmodified_tensors_reduce_once_per_key() -> None:
    owner, other = torch.tensor([1, 2]), torch.tensor([3])
    compute = Counter("r")
    assert [reduce_once(owner, (other,), "k", compute) for _ in range(5)] == ["r"] * 5
    assert compute.calls == 1
    reduce_once(owner, (other,), "other key", compute)
    reduce_once(owner, (other,), "k", compute)
    assert compute.calls == 2  # each key keeps its own result


@pytest.mark.parametrize("change", ["owner in place", "owner view in place", "other in place", "other replaced"])
def test_any_change_recomputes(change: str) -> None:
    owner, other = torch.tensor([1, 2, 3]), torch.tensor([4])
    compute = Counter(0)
    reduce_once(owner, (other,), "k", compute)
    if change == "owner in place":
        owner.add_(1)
    elif change == "owner view in place":
        owner[1:].zero_()
    elif change == "other in place":
        other[0] = 9
    else:
        other = torch.tensor([4])  # equal values, another tensor
    reduce_once(owner, (other,), "k", compute)
    assert compute.calls == 2


def test_inference_tensors_are_reduced_every_time() -> None:
    with torch.inference_mode():
        owner = torch.tensor([1, 2])
    compute = Counter(0)
    reduce_once(owner, (), "k", compute)
    reduce_once(owner, (), "k", compute)
    assert compute.calls == 2


def _cache() -> tuple[torch.Tensor, torch.Tensor]:
    sizes = (NUM_BLOCKS, KV_HEADS, HEAD, BLOCK, torch.float32)
    return torch.zeros(kernels.key_cache_shape(*sizes)), torch.zeros(kernels.value_cache_shape(*sizes))


def _decode_args(block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int) -> tuple:
    key_cache, value_cache = _cache()
    query = torch.zeros(block_tables.shape[0], 4, HEAD)
    return (torch.empty_like(query), query, key_cache, value_cache, KV_HEADS, 0.25, block_tables, context_lens,
            BLOCK, max_context_len, None, None)


def test_decode_check_sees_a_block_id_changed_in_place_between_layers() -> None:
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    for _ in range(3):  # three layers
        assert check_paged_attention_args(*_decode_args(tables, lens, 8))[1] == 8
    tables[1, 1] = NUM_BLOCKS  # out of range
    with pytest.raises(ValueError, match="block ids in"):
        check_paged_attention_args(*_decode_args(tables, lens, 8))


def test_decode_check_compares_the_reused_longest_context_with_each_calls_bound() -> None:
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([7], dtype=torch.int32)
    check_paged_attention_args(*_decode_args(tables, lens, 7))
    with pytest.raises(ValueError, match="max_context_len=6"):
        check_paged_attention_args(*_decode_args(tables, lens, 6))


def test_prefill_check_returns_fresh_lists_and_sees_changes() -> None:
    key_cache, value_cache = _cache()
    query = torch.zeros(6, 4, HEAD)
    tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    starts = torch.tensor([0, 4, 6], dtype=torch.int32)
    lens = torch.tensor([4, 2], dtype=torch.int32)

    def check() -> tuple:
        return check_context_attention_args(torch.empty_like(query), query, key_cache, value_cache, KV_HEADS, 0.25,
                                            tables, starts, lens, BLOCK, None, None)

    _, first_starts, first_lens = check()
    first_starts.append(99)  # a caller's change must not leak into the next layer's answer
    _, again_starts, again_lens = check()
    assert (again_starts, again_lens) == ([0, 4, 6], [4, 2]) == (first_starts[:-1], first_lens)
    lens[1] = 3  # more context than queries is fine; seq 1 still fits its table
    assert check()[2] == [4, 3]
    tables[0, 0] = -1
    with pytest.raises(ValueError, match="block ids in"):
        check()


def test_reshape_and_cache_check_sees_a_slot_changed_in_place() -> None:
    key_cache, value_cache = _cache()
    slots = torch.tensor([0, 5, 9], dtype=torch.int64)
    kv = torch.zeros(3, KV_HEADS, HEAD)
    check_reshape_and_cache_args(kv, kv, key_cache, value_cache, slots)
    slots[2] = NUM_BLOCKS * BLOCK
    with pytest.raises(ValueError, match="slot_mapping has slot"):
        check_reshape_and_cache_args(kv, kv, key_cache, value_cache, slots)
