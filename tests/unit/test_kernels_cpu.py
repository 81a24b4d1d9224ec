"""CPU paged KV-cache kernels against the float64 loop references.

Attention cases (NaN-poisoned caches and outputs, permuted block tables) come
from :mod:`tests.kernel_cases`, shared with the CUDA tests; contexts are ragged.
Decode and prefill attention each have two CPU twins, the torch kernel and the
Numba kernel the CPU backend uses; every attention case runs on both.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples

from llmserve import kernels
from llmserve.kernels.backend import ContextAttentionFn, PagedAttentionFn
from llmserve.kernels.cpu import attention as cpu_attention
from llmserve.kernels.cpu import numba_attention, numba_cache_ops
from tests import kernel_cases
from tests.kernel_cases import (
    TOLERANCE,
    PagedCache,
    cache_write_case,
    alibi_slopes_for,
    config_id,
    feature_id,
    nan_like,
    rel_error,
    stable_seed,
)
from tests.kernels_reference import ref_paged_attention

# (dtype, num_heads, num_kv_heads, head_size, block_size): GQA, MHA and MQA,
# every head size and block size, each dtype at least twice.
ATTENTION_CONFIGS = [
    (torch.float32, 8, 2, 64, 16),
    (torch.float32, 8, 8, 80, 8),
    (torch.float32, 4, 1, 96, 32),
    (torch.float32, 8, 2, 128, 16),
    (torch.bfloat16, 8, 2, 64, 16),
    (torch.bfloat16, 4, 1, 128, 8),
    (torch.float16, 8, 2, 96, 32),
    (torch.float16, 8, 8, 80, 16),
    (torch.float64, 4, 2, 64, 8),
]
# (use_alibi, sliding_window)
FEATURES = [(False, None), (True, None), (False, 11), (True, 11)]
# Both decode kernels; parametrize a decode test with `@for_each_decode_kernel` and take `paged`.
for_each_decode_kernel = pytest.mark.parametrize(
    "paged", [cpu_attention.paged_attention, numba_attention.paged_attention], ids=["torch", "numba"]
)
# Both prefill kernels, likewise: `@for_each_context_kernel`, taking `context`.
for_each_context_kernel = pytest.mark.parametrize(
    "context", [cpu_attention.context_attention, numba_attention.context_attention], ids=["torch", "numba"]
)


@for_each_decode_kernel
@pytest.mark.parametrize("feature", FEATURES, ids=feature_id)
@pytest.mark.parametrize("cfg", ATTENTION_CONFIGS, ids=config_id)
def test_paged_attention_matches_reference(paged: PagedAttentionFn, cfg: tuple, feature: tuple) -> None:
    block_size = cfg[4]
    # Ragged: one token, exactly one block, one past a block, a long odd length.
    context_lens = [1, block_size, block_size + 1, 3 * block_size - 5, 2 * block_size + 3]
    seed = stable_seed(config_id(cfg), feature_id(feature))
    err = kernel_cases.run_paged(paged, cfg, context_lens, *feature, seed=seed)
    assert err < TOLERANCE[cfg[0]]


@for_each_decode_kernel
@pytest.mark.parametrize("sliding_window", [1, 2, 7, 8, 9, 30, 1000])
@pytest.mark.parametrize("use_alibi", [False, True])
def test_paged_attention_sliding_window_sizes(paged: PagedAttentionFn, sliding_window: int, use_alibi: bool) -> None:
    # Windows smaller than, equal to, straddling and larger than blocks and contexts.
    cfg = (torch.float32, 4, 2, 64, 8)
    seed = sliding_window + 100 * use_alibi
    err = kernel_cases.run_paged(paged, cfg, [1, 7, 8, 9, 23, 40], use_alibi, sliding_window, seed=seed)
    assert err < TOLERANCE[torch.float32]


@for_each_decode_kernel
@pytest.mark.parametrize("cfg", [(torch.float32, 6, 2, 64, 8), (torch.bfloat16, 4, 1, 64, 16)], ids=config_id)
@pytest.mark.parametrize("feature", [(False, None), (True, None), (False, 700), (True, 300)], ids=feature_id)
def test_paged_attention_long_contexts(paged: PagedAttentionFn, cfg: tuple, feature: tuple) -> None:
    # The Numba kernel takes the softmax over spans of 32 blocks and joins spans by rescaling: contexts
    # of several spans, ending inside one or on its edge, with windows that start inside a later span.
    block_size = cfg[4]
    span = 32 * block_size
    context_lens = [span + 1, 2 * span, 3 * span + block_size + 3, span - 1]
    err = kernel_cases.run_paged(paged, cfg, context_lens, *feature, seed=stable_seed(config_id(cfg), feature_id(feature)))
    assert err < TOLERANCE[cfg[0]]


@for_each_decode_kernel
@pytest.mark.parametrize("cfg", [(torch.float32, 6, 2, 64, 8), (torch.bfloat16, 4, 1, 64, 16)], ids=config_id)
@pytest.mark.parametrize("feature", [(False, None), (True, 300), (False, 21)], ids=feature_id)
def test_paged_attention_ignores_stale_slots(paged: PagedAttentionFn, cfg: tuple, feature: tuple) -> None:
    # Slots past the context and before the window hold what a reused block left there (large finite keys
    # and values): none may weigh in. Contexts end inside a block, on a block's edge, inside a later span.
    block_size = cfg[4]
    context_lens = [block_size + 3, 2 * block_size, 33 * block_size + 5, 5]
    seed = stable_seed(config_id(cfg), feature_id(feature), "stale")
    err = kernel_cases.run_paged(paged, cfg, context_lens, *feature, seed=seed, stale=True)
    assert err < TOLERANCE[cfg[0]]


@for_each_decode_kernel
@pytest.mark.parametrize("unused_entry", [0, -1])
def test_paged_attention_ignores_unused_block_table_entries(paged: PagedAttentionFn, unused_entry: int) -> None:
    cfg = (torch.float32, 8, 2, 64, 16)
    err = kernel_cases.run_paged(paged, cfg, [3, 17, 33], False, None, seed=5, unused_table_entry=unused_entry)
    assert err < TOLERANCE[torch.float32]


def test_paged_attention_chunked_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tiny gather budget forces one-sequence chunks; results must not change.
    monkeypatch.setattr(cpu_attention, "_DECODE_GATHER_BUDGET", 1)
    cfg = (torch.float32, 8, 2, 64, 8)
    err = kernel_cases.run_paged(cpu_attention.paged_attention, cfg, [1, 9, 30, 16], True, 13, seed=6)
    assert err < TOLERANCE[torch.float32]


@for_each_decode_kernel
def test_paged_attention_zero_length_context_gives_zeros(paged: PagedAttentionFn) -> None:
    gen = torch.Generator().manual_seed(7)
    cache = PagedCache([5, 0, 12], 2, 64, 8, torch.float32, gen)
    query = torch.randn(3, 4, 64, generator=gen)
    out = nan_like(query)
    lens = torch.tensor([5, 0, 12], dtype=torch.int32)
    paged(out, query, cache.key_cache, cache.value_cache, 2, 0.125, cache.block_tables, lens, 8, 12)
    expected = ref_paged_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, lens, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_error(out, expected) < TOLERANCE[torch.float32]


@for_each_decode_kernel
def test_paged_attention_loose_max_context_len(paged: PagedAttentionFn) -> None:
    # max_context_len is an upper bound; a loose one must not change the result.
    gen = torch.Generator().manual_seed(8)
    cache = PagedCache([4, 19], 1, 64, 16, torch.float32, gen)
    query = torch.randn(2, 2, 64, generator=gen)
    lens = torch.tensor([4, 19], dtype=torch.int32)
    out = nan_like(query)
    paged(out, query, cache.key_cache, cache.value_cache, 1, 0.125, cache.block_tables, lens, 16, 4096)
    expected = ref_paged_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, lens, 0.125)
    assert rel_error(out, expected) < TOLERANCE[torch.float32]


@for_each_decode_kernel
@settings(max_examples=examples(12), deadline=None)
@given(
    data=st.data(),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    block_size=st.sampled_from([8, 16]),
    use_alibi=st.booleans(),
    sliding_window=st.one_of(st.none(), st.integers(1, 40)),
)
def test_paged_attention_property(
    paged: PagedAttentionFn,
    data: st.DataObject,
    num_kv_heads: int,
    group: int,
    block_size: int,
    use_alibi: bool,
    sliding_window: int | None,
) -> None:
    context_lens = data.draw(st.lists(st.integers(1, 45), min_size=1, max_size=4))
    seed = data.draw(st.integers(0, 2**31 - 1))
    cfg = (torch.float32, num_kv_heads * group, num_kv_heads, 64, block_size)
    assert kernel_cases.run_paged(paged, cfg, context_lens, use_alibi, sliding_window, seed) < TOLERANCE[torch.float32]


# ---------------------------------------------------------------- context attention

CONTEXT_FEATURES = [(False, None), (True, None), (False, 6), (True, 6)]


@for_each_context_kernel
@pytest.mark.parametrize("feature", CONTEXT_FEATURES, ids=feature_id)
@pytest.mark.parametrize("cfg", ATTENTION_CONFIGS, ids=config_id)
def test_context_attention_matches_reference(context: ContextAttentionFn, cfg: tuple, feature: tuple) -> None:
    block_size = cfg[4]
    seqs = [
        (block_size + 3, block_size + 3),  # pure prefill, not a block multiple
        (2 * block_size + 5, 6),  # chunk after a cached prefix, spanning blocks
        (block_size, block_size),  # pure prefill, exactly one block
        (9, 1),  # one new token after a prefix
        (1, 1),  # one-token prompt
        (7, 0),  # sequence with no queries this step
    ]
    seed = stable_seed("ctx", config_id(cfg), feature_id(feature))
    err = kernel_cases.run_context(context, cfg, seqs, *feature, seed=seed)
    assert err < TOLERANCE[cfg[0]]


@for_each_context_kernel
@pytest.mark.parametrize("feature", CONTEXT_FEATURES, ids=feature_id)
@pytest.mark.parametrize("cfg", [(torch.float32, 6, 2, 64, 8), (torch.bfloat16, 4, 1, 64, 16)], ids=config_id)
def test_context_attention_ignores_stale_slots(context: ContextAttentionFn, cfg: tuple, feature: tuple) -> None:
    # As for decode: slots past each sequence hold a reused block's large finite keys and values.
    block_size = cfg[4]
    seqs = [(block_size + 3, block_size + 3), (2 * block_size + 5, 6), (9, 1), (40 * block_size + 7, 100)]
    seed = stable_seed("ctx-stale", config_id(cfg), feature_id(feature))
    err = kernel_cases.run_context(context, cfg, seqs, *feature, seed=seed, stale=True)
    assert err < TOLERANCE[cfg[0]]


@pytest.mark.parametrize("budget", [1, 300])
@pytest.mark.parametrize("feature", CONTEXT_FEATURES, ids=feature_id)
def test_context_attention_query_tiles(monkeypatch: pytest.MonkeyPatch, budget: int, feature: tuple) -> None:
    # A tiny scores budget splits prompts into 1-query (or few-query) tiles, each
    # with its own causal / window key range; results must not change.
    monkeypatch.setattr(cpu_attention, "_PREFILL_SCORES_BUDGET", budget)
    seqs = [(21, 21), (30, 11), (5, 1)]
    seed = stable_seed("tiles", str(budget), feature_id(feature))
    err = kernel_cases.run_context(cpu_attention.context_attention, (torch.float32, 4, 2, 64, 8), seqs, *feature, seed)
    assert err < TOLERANCE[torch.float32]


@for_each_context_kernel
@settings(max_examples=examples(10), deadline=None)
@given(
    data=st.data(),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    block_size=st.sampled_from([8, 16]),
    use_alibi=st.booleans(),
    sliding_window=st.one_of(st.none(), st.integers(1, 30)),
)
def test_context_attention_property(
    context: ContextAttentionFn,
    data: st.DataObject,
    num_kv_heads: int,
    group: int,
    block_size: int,
    use_alibi: bool,
    sliding_window: int | None,
) -> None:
    seq_lens = data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=3))
    seqs = [(n, data.draw(st.integers(0, n))) for n in seq_lens]
    seed = data.draw(st.integers(0, 2**31 - 1))
    cfg = (torch.float32, num_kv_heads * group, num_kv_heads, 64, block_size)
    if sum(q for _, q in seqs) == 0:
        seqs[0] = (seqs[0][0], 1)
    assert kernel_cases.run_context(context, cfg, seqs, use_alibi, sliding_window, seed) < TOLERANCE[torch.float32]


@for_each_decode_kernel
@for_each_context_kernel
def test_context_attention_with_one_query_per_sequence_equals_paged_attention(
    context: ContextAttentionFn, paged: PagedAttentionFn
) -> None:
    gen = torch.Generator().manual_seed(9)
    lens_list = [1, 8, 13, 30]
    cache = PagedCache(lens_list, 2, 64, 8, torch.float32, gen)
    query = torch.randn(4, 8, 64, generator=gen)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    slopes = alibi_slopes_for(8)
    decode, prefill = nan_like(query), nan_like(query)
    paged(decode, query, cache.key_cache, cache.value_cache, 2, 0.125, cache.block_tables, lens, 8, 30, slopes, 10)
    qsl = torch.arange(5, dtype=torch.int32)
    context(prefill, query, cache.key_cache, cache.value_cache, 2, 0.125, cache.block_tables, qsl, lens, 8, slopes, 10)
    torch.testing.assert_close(decode, prefill, rtol=1e-5, atol=1e-5)


@for_each_decode_kernel
@for_each_context_kernel
def test_attention_accepts_strided_query_and_out_and_empty_batches(
    context: ContextAttentionFn, paged: PagedAttentionFn
) -> None:
    # Query/out are often views into a fused qkv / output buffer.
    gen = torch.Generator().manual_seed(15)
    cache = PagedCache([6, 20], 2, 64, 8, torch.float32, gen)
    fused = torch.randn(2, 3, 4, 64, generator=gen)  # [S, q/k/v, H, D]
    query = fused[:, 0]
    out_buffer = torch.full((2, 4, 2, 64), float("nan"))
    out = out_buffer[:, :, 1]
    lens = torch.tensor([6, 20], dtype=torch.int32)
    paged(out, query, cache.key_cache, cache.value_cache, 2, 0.125, cache.block_tables, lens, 8, 20)
    expected = ref_paged_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, lens, 0.125)
    assert rel_error(out, expected) < TOLERANCE[torch.float32]
    assert torch.isnan(out_buffer[:, :, 0]).all()  # neighbours untouched

    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill = torch.full_like(query, float("nan"))
    context(prefill, query, cache.key_cache, cache.value_cache, 2, 0.125, cache.block_tables, qsl, lens, 8)
    torch.testing.assert_close(prefill, out, rtol=1e-5, atol=1e-5)

    empty = torch.empty(0, 4, 64)
    no_rows = torch.empty(0, cache.block_tables.shape[1], dtype=torch.int32)
    no_lens = torch.empty(0, dtype=torch.int32)
    paged(empty, empty, cache.key_cache, cache.value_cache, 2, 0.125, no_rows, no_lens, 8, 0)
    no_starts = torch.zeros(1, dtype=torch.int32)
    caches = (cache.key_cache, cache.value_cache)
    context(empty, empty, *caches, 2, 0.125, no_rows, no_starts, no_lens, 8)


# ---------------------------------------------------------------- cache ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    case = cache_write_case(dtype, 6, 2, 64, 8, num_tokens=20, padding=[0, 7, 19], seed=10)
    kernels.reshape_and_cache(case.key, case.value, case.key_cache, case.value_cache, case.slot_mapping)
    assert torch.equal(case.key_cache, case.expected_key_cache)
    assert torch.equal(case.value_cache, case.expected_value_cache)


def test_reshape_and_cache_element_addressing() -> None:
    # Pin the layout itself: token t at slot s lands at key_cache[s // bs, h, d // x, s % bs, d % x].
    key_cache, value_cache = (c[0] for c in kernels.allocate_kv_cache(1, 4, 2, 16, 4, torch.float16, "cpu"))
    key = torch.arange(2 * 16, dtype=torch.float16).view(1, 2, 16)
    value = -key
    kernels.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([13]))
    block, offset, x = 13 // 4, 13 % 4, 8
    for h in range(2):
        for d in range(16):
            assert key_cache[block, h, d // x, offset, d % x] == key[0, h, d]
            assert value_cache[block, h, d, offset] == value[0, h, d]
    assert int((key_cache != 0).sum()) == 2 * 16 - 1  # everything else untouched (key[0,0,0] is 0)


def test_reshape_and_cache_all_padding_is_a_no_op() -> None:
    key_caches, value_caches = kernels.allocate_kv_cache(1, 2, 1, 8, 4, torch.float32, "cpu")
    key = torch.ones(3, 1, 8)
    kernels.reshape_and_cache(key, key, key_caches[0], value_caches[0], torch.full((3,), -1))
    assert not key_caches[0].any() and not value_caches[0].any()


def test_copy_blocks_is_exact_for_every_layer() -> None:
    gen = torch.Generator().manual_seed(11)
    layers = 3
    sizes = (8, 2, 32, 4, torch.float16)
    key_caches = [torch.randn(kernels.key_cache_shape(*sizes), generator=gen).half() for _ in range(layers)]
    value_caches = [torch.randn(kernels.value_cache_shape(*sizes), generator=gen).half() for _ in range(layers)]
    before_k = [k.clone() for k in key_caches]
    before_v = [v.clone() for v in value_caches]
    # Block 5 is both a source and a destination: sources are read before writes.
    mapping = torch.tensor([[2, 5], [3, 7], [5, 1]], dtype=torch.int64)
    kernels.copy_blocks(key_caches, value_caches, mapping)
    for layer in range(layers):
        for caches, before in ((key_caches, before_k), (value_caches, before_v)):
            expected = before[layer].clone()
            for src, dst in mapping.tolist():
                expected[dst] = before[layer][src]
            assert torch.equal(caches[layer], expected)


def test_swap_blocks_is_exact_between_caches_of_different_sizes() -> None:
    gen = torch.Generator().manual_seed(12)
    for shape_fn in (kernels.key_cache_shape, kernels.value_cache_shape):
        src = torch.randn(shape_fn(6, 2, 32, 8, torch.bfloat16), generator=gen).bfloat16()
        dst = torch.randn(shape_fn(4, 2, 32, 8, torch.bfloat16), generator=gen).bfloat16()
        src_before, expected = src.clone(), dst.clone()
        mapping = torch.tensor([[5, 0], [0, 3], [2, 2]], dtype=torch.int64)
        kernels.swap_blocks(src, dst, mapping)
        for s, d in mapping.tolist():
            expected[d] = src_before[s]
        assert torch.equal(dst, expected)
        assert torch.equal(src, src_before)


# ---------------------------------------------------------------- layout and backend


@pytest.mark.parametrize(
    ("dtype", "x"), [(torch.float32, 4), (torch.float16, 8), (torch.bfloat16, 8), (torch.float64, 2)]
)
def test_layout_shapes(dtype: torch.dtype, x: int) -> None:
    assert kernels.kv_pack_factor(dtype) == x
    assert kernels.key_cache_shape(10, 2, 64, 16, dtype) == (10, 2, 64 // x, 16, x)
    assert kernels.value_cache_shape(10, 2, 64, 16, dtype) == (10, 2, 64, 16)
    keys, values = kernels.allocate_kv_cache(3, 10, 2, 64, 16, dtype, torch.device("cpu"))
    assert len(keys) == len(values) == 3
    for k, v in zip(keys, values):
        assert k.shape == (10, 2, 64 // x, 16, x) and v.shape == (10, 2, 64, 16)
        assert k.dtype == v.dtype == dtype
        assert not k.any() and not v.any()
    assert keys[0].data_ptr() != keys[1].data_ptr()


@pytest.mark.parametrize(
    "call",
    [
        lambda: kernels.kv_pack_factor(torch.int32),
        lambda: kernels.key_cache_shape(10, 2, 66, 16, torch.float32),  # 66 % 4 != 0
        lambda: kernels.key_cache_shape(10, 2, 68, 16, torch.float16),  # 68 % 8 != 0
        lambda: kernels.value_cache_shape(0, 2, 64, 16, torch.float32),
        lambda: kernels.key_cache_shape(10, 2, 64, True, torch.float32),
        lambda: kernels.allocate_kv_cache(0, 10, 2, 64, 16, torch.float32, "cpu"),
        lambda: kernels.allocate_kv_cache(1, 10, 2, 64, 16, torch.float32, "meta", pin_memory=True),
        lambda: kernels.get_backend("not-a-device"),
    ],
)
def test_layout_rejects_invalid_arguments(call) -> None:
    with pytest.raises(ValueError):
        call()


def test_get_backend() -> None:
    backend = kernels.get_backend("cpu")
    assert isinstance(backend, kernels.KernelBackend)
    assert backend.paged_attention is numba_attention.paged_attention
    assert backend.context_attention is numba_attention.context_attention
    assert backend.reshape_and_cache is numba_cache_ops.reshape_and_cache
    assert backend.copy_blocks is kernels.copy_blocks
    assert backend.swap_blocks is kernels.swap_blocks
    assert kernels.get_backend(torch.device("cpu")) == backend
    # The CUDA backend is only picked here (its kernels are tested in test_kernels_cuda.py).
    assert kernels.get_backend("cuda:0").name == "cuda"
    with pytest.raises(NotImplementedError, match="mps"):
        kernels.get_backend("mps")


# ---------------------------------------------------------------- invalid arguments


def _decode_args() -> dict:
    gen = torch.Generator().manual_seed(13)
    cache = PagedCache([5, 12], 2, 64, 8, torch.float32, gen)
    query = torch.randn(2, 4, 64, generator=gen)
    return dict(
        out=torch.empty_like(query),
        query=query,
        key_cache=cache.key_cache,
        value_cache=cache.value_cache,
        num_kv_heads=2,
        scale=0.125,
        block_tables=cache.block_tables,
        context_lens=torch.tensor([5, 12], dtype=torch.int32),
        block_size=8,
        max_context_len=12,
    )


DECODE_BAD = {
    "kv_heads_mismatch": dict(num_kv_heads=1),
    "heads_not_multiple": dict(query=torch.randn(2, 3, 64), out=torch.empty(2, 3, 64)),
    "out_shape": dict(out=torch.empty(2, 4, 32)),
    "head_size": dict(query=torch.randn(2, 4, 32), out=torch.empty(2, 4, 32)),
    "block_size": dict(block_size=16),
    "scale_zero": dict(scale=0.0),
    "scale_nan": dict(scale=math.nan),
    "window_zero": dict(sliding_window=0),
    "alibi_shape": dict(alibi_slopes=torch.ones(3)),
    "context_over_max": dict(max_context_len=11),
    "negative_context": dict(context_lens=torch.tensor([-1, 12], dtype=torch.int32)),
    "context_lens_float": dict(context_lens=torch.tensor([5.0, 12.0])),
    "context_lens_count": dict(context_lens=torch.tensor([5], dtype=torch.int32)),
    "table_too_narrow": dict(context_lens=torch.tensor([5, 60], dtype=torch.int32), max_context_len=60),
    "table_block_out_of_range": dict(block_tables=torch.tensor([[99, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.int32)),
    "table_float": dict(block_tables=torch.zeros(2, 4)),
    "cache_dtype_mismatch": "value_cache_half",
}


@for_each_decode_kernel
@pytest.mark.parametrize("name", list(DECODE_BAD))
def test_paged_attention_rejects_invalid_arguments(paged: PagedAttentionFn, name: str) -> None:
    args = _decode_args()
    change = DECODE_BAD[name]
    if change == "value_cache_half":
        args["value_cache"] = args["value_cache"].half()
    else:
        args.update(change)
    with pytest.raises(ValueError):
        paged(**args)


def _prefill_args() -> dict:
    gen = torch.Generator().manual_seed(14)
    cache = PagedCache([5, 12], 2, 64, 8, torch.float32, gen)
    query = torch.randn(9, 4, 64, generator=gen)
    return dict(
        out=torch.empty_like(query),
        query=query,
        key_cache=cache.key_cache,
        value_cache=cache.value_cache,
        num_kv_heads=2,
        scale=0.125,
        block_tables=cache.block_tables,
        query_start_loc=torch.tensor([0, 5, 9], dtype=torch.int32),
        seq_lens=torch.tensor([5, 12], dtype=torch.int32),
        block_size=8,
    )


PREFILL_BAD = {
    "qsl_length": dict(query_start_loc=torch.tensor([0, 9], dtype=torch.int32)),
    "qsl_end": dict(query_start_loc=torch.tensor([0, 5, 8], dtype=torch.int32)),
    "qsl_start": dict(query_start_loc=torch.tensor([1, 5, 9], dtype=torch.int32)),
    "qsl_decreasing": dict(query_start_loc=torch.tensor([0, 10, 9], dtype=torch.int32)),
    "q_len_over_seq_len": dict(seq_lens=torch.tensor([4, 12], dtype=torch.int32)),
    "table_too_narrow": dict(seq_lens=torch.tensor([5, 60], dtype=torch.int32)),
    "table_rows": dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)),
    "kv_heads": dict(num_kv_heads=4),
    "window_negative": dict(sliding_window=-3),
}


@for_each_context_kernel
@pytest.mark.parametrize("name", list(PREFILL_BAD))
def test_context_attention_rejects_invalid_arguments(context: ContextAttentionFn, name: str) -> None:
    args = _prefill_args()
    args.update(PREFILL_BAD[name])
    with pytest.raises(ValueError):
        context(**args)


def test_cache_ops_reject_invalid_arguments() -> None:
    keys, values = kernels.allocate_kv_cache(2, 4, 2, 16, 4, torch.float32, "cpu")
    kv = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.reshape_and_cache(kv, kv, keys[0], values[0], torch.tensor([0, 1, 16]))  # 16 slots only
    with pytest.raises(ValueError, match="key"):
        kernels.reshape_and_cache(torch.zeros(3, 2, 8), kv, keys[0], values[0], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="dtype"):
        kernels.reshape_and_cache(kv.half(), kv.half(), keys[0], values[0], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.reshape_and_cache(kv, kv, keys[0], values[0], torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="block_mapping"):
        kernels.copy_blocks(keys, values, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="block_mapping"):
        kernels.copy_blocks(keys, values, torch.tensor([[0, 1], [2, 1]]))  # repeated destination
    with pytest.raises(ValueError, match="block_mapping"):
        kernels.copy_blocks(keys, values, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="layers"):
        kernels.copy_blocks(keys, values[:1], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="block shape"):
        kernels.swap_blocks(keys[0], values[0], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="block_mapping"):
        kernels.swap_blocks(keys[0], keys[1], torch.tensor([[-1, 1]]))
    with pytest.raises(ValueError, match="dtype"):
        kernels.swap_blocks(keys[0], keys[1].half(), torch.tensor([[0, 1]]))


def test_import_reads_no_environment() -> None:
    # Backends are chosen by argument, never by environment at import time.
    import ast
    import pathlib

    root = pathlib.Path(kernels.__file__).parent
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
            n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
        }
        assert "environ" not in names and "getenv" not in names, path


def test_allocated_layers_stack_into_one_tensor_and_others_do_not() -> None:
    from llmserve.kernels.layout import stacked_layers

    keys, values = kernels.allocate_kv_cache(3, 5, 2, 8, 4, torch.float32, "cpu")
    for layers in (keys, values):
        stack = stacked_layers(layers)
        assert stack is not None and stack.shape == (3, *layers[0].shape)
        layers[1].fill_(7.0)  # the stack is the same memory, layer by layer
        assert torch.equal(stack[1], layers[1]) and not stack[0].eq(7.0).any() and not stack[2].eq(7.0).any()
    # Separate allocations, another order, a missing layer, mixed shapes: not one run of one allocation.
    assert stacked_layers([k.clone() for k in keys]) is None
    assert stacked_layers([keys[1], keys[0], keys[2]]) is None
    assert stacked_layers([keys[0], keys[2]]) is None
    assert stacked_layers([values[0], values[0].view(keys[0].shape)]) is None
    assert stacked_layers([keys[0]]) is not None
