"""What is particular to the Numba attention kernels: which inputs take them, the prefill kernel's
tiling, and batches shaped like the worker's.

Their correctness cases are also the torch twins', in test_kernels_cpu.py (every
attention test there runs on both kernels); the prefill property test here adds what
only the Numba kernel has: query tiles (several per prompt), GQA groups of 3, bf16
caches and long windows.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples

from llmserve.kernels.cpu import _numba_blocks, _numba_decode, _numba_prefill
from llmserve.kernels.cpu import attention as cpu_attention
from llmserve.kernels.cpu import numba_attention
from llmserve.kernels.cpu.numpy_views import numpy_view
from tests import kernel_cases
from tests.kernel_cases import TOLERANCE, PagedCache, alibi_slopes_for, nan_like, rel_error
from tests.kernels_reference import ref_context_attention, ref_paged_attention


@pytest.fixture
def torch_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.dtype]]:
    """Records (kernel, cache dtype) of every call that falls back to a torch kernel."""
    calls: list[tuple[str, torch.dtype]] = []
    for name in ("paged_attention", "context_attention"):
        torch_kernel = getattr(cpu_attention, name)  # the patch below replaces this very attribute

        def spy(*args: object, _name: str = name, _kernel: object = torch_kernel, **kwargs: object) -> None:
            calls.append((_name, args[2].dtype))  # type: ignore[attr-defined]
            _kernel(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(numba_attention.torch_attention, name, spy)
    return calls


@pytest.mark.parametrize(
    "dtype, numba_runs",
    [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False), (torch.float64, False)],
)
def test_dtypes_pick_numba_or_the_torch_fallback(torch_calls: list, dtype: torch.dtype, numba_runs: bool) -> None:
    cfg = (dtype, 8, 2, 64, 16)
    err = kernel_cases.run_paged(numba_attention.paged_attention, cfg, [1, 16, 17, 40], True, 20, seed=21)
    assert err < TOLERANCE[dtype]
    assert torch_calls == ([] if numba_runs else [("paged_attention", dtype)])


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
    assert torch_calls == [("paged_attention", torch.float32)] * 2


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


def test_checks_run_again_for_a_call_laid_out_differently_in_the_same_step() -> None:
    # The checks of a step's first call are reused by calls with the same metadata and tensors laid out
    # alike (the other layers); a call whose tensors differ is checked on its own, and a strided query
    # (a view of fused q/k/v rows) is read in place with the same result as a contiguous one.
    gen = torch.Generator().manual_seed(5)
    lens_list = [40, 7, 33]
    cache = PagedCache(lens_list, 3, 64, 16, torch.float32, gen)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    fused = torch.randn(3, 9 * 64 + 128, generator=gen)
    query = fused[:, : 9 * 64].view(3, 9, 64)
    args = (3, 0.125, cache.block_tables, lens, 16, 40)
    strided, dense = nan_like(query), nan_like(query)
    numba_attention.paged_attention(strided, query, cache.key_cache, cache.value_cache, *args)
    numba_attention.paged_attention(dense, query.contiguous(), cache.key_cache, cache.value_cache, *args)
    torch.testing.assert_close(strided, dense, rtol=0, atol=0)
    small = cache.key_cache[:-1]  # one block short: the step's block ids may not fit
    with pytest.raises(ValueError, match="key_cache|value_cache|blocks"):
        numba_attention.paged_attention(nan_like(query), query, small, cache.value_cache, *args)


def test_kernel_threads_follow_torch_threads() -> None:
    # The worker's --num-threads sets torch's threads; the kernel must not use more.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        kernel_cases.run_paged(numba_attention.paged_attention, (torch.float32, 4, 2, 64, 8), [9], False, None, 24)
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- prefill


def _batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, seed: int) -> tuple:
    """A float32 cache (head size 64, block size 16) holding ``seqs`` ((seq_len, q_len) each) and their queries."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedCache([n for n, _ in seqs], num_kv_heads, 64, 16, torch.float32, gen)
    starts = np.cumsum([0] + [q for _, q in seqs]).tolist()
    query = torch.randn(starts[-1], num_heads, 64, generator=gen)
    qsl = torch.tensor(starts, dtype=torch.int32)
    lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32)
    return query, cache, qsl, lens


def test_prefill_checks_once_per_layout_and_reads_a_strided_query_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # As for decode: the checks and work items of a step's first call serve the calls with the same metadata and
    # tensors laid out alike; a strided query (a view of fused q/k/v rows) is read in place, bit for bit as a
    # contiguous one; a call laid out differently (a contiguous query, a cache one block short) is checked on its own.
    checked = []
    check = numba_attention.check_context_attention_args
    monkeypatch.setattr(numba_attention, "check_context_attention_args",
                        lambda *args: checked.append(args[1].is_contiguous()) or check(*args))
    query, cache, qsl, lens = _batch([(40, 40), (90, 17), (5, 5)], 9, 3, seed=38)
    fused = torch.cat([query.flatten(1), torch.randn(query.shape[0], 128)], dim=1)
    strided_query = fused[:, : 9 * 64].view(query.shape)
    assert not strided_query.is_contiguous()
    args = (3, 0.125, cache.block_tables, qsl, lens, 16)
    strided, dense, again = nan_like(query), nan_like(query), nan_like(query)
    numba_attention.context_attention(strided, strided_query, cache.key_cache, cache.value_cache, *args)
    numba_attention.context_attention(dense, query, cache.key_cache, cache.value_cache, *args)
    numba_attention.context_attention(again, strided_query, cache.key_cache, cache.value_cache, *args)
    assert checked == [False, True]  # the third call, laid out as the first, reused its checks
    torch.testing.assert_close(strided, dense, rtol=0, atol=0)
    torch.testing.assert_close(again, dense, rtol=0, atol=0)
    small = cache.key_cache[: int(cache.block_tables.max())]  # the highest block id no longer fits
    with pytest.raises(ValueError, match="key_cache|value_cache|blocks"):
        numba_attention.context_attention(nan_like(query), query, small, cache.value_cache, *args)
    assert len(checked) == 3


@pytest.mark.parametrize(
    "dtype, numba_runs",
    [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False), (torch.float64, False)],
)
def test_prefill_dtypes_pick_numba_or_torch(torch_calls: list, dtype: torch.dtype, numba_runs: bool) -> None:
    cfg = (dtype, 8, 2, 64, 16)
    seqs = [(40, 40), (37, 5), (1, 1)]
    err = kernel_cases.run_context(numba_attention.context_attention, cfg, seqs, True, 20, seed=31)
    assert err < TOLERANCE[dtype]
    assert torch_calls == ([] if numba_runs else [("context_attention", dtype)])


def test_odd_block_sizes_and_non_contiguous_caches_fall_back(torch_calls: list) -> None:
    # The kernel takes 4 slots of a block per pass: a block of 6 goes to the torch kernel.
    err = kernel_cases.run_context(numba_attention.context_attention, (torch.float32, 4, 2, 64, 6), [(13, 9)], False,
                                   None, seed=32)  # fmt: skip
    assert err < TOLERANCE[torch.float32]
    query, cache, qsl, lens = _batch([(20, 12)], 4, 2, seed=33)
    # Every other kv head: a strided view of the same blocks.
    wide_keys = torch.stack([cache.key_cache, cache.key_cache], dim=2).flatten(1, 2)[:, ::2]
    out = nan_like(query)
    numba_attention.context_attention(out, query, wide_keys, cache.value_cache, 2, 0.125, cache.block_tables, qsl,
                                      lens, 16)  # fmt: skip
    assert torch_calls == [("context_attention", torch.float32)] * 2
    expected = ref_context_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, qsl, lens, 0.125)
    assert rel_error(out, expected) < TOLERANCE[torch.float32]


@settings(max_examples=examples(25), deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    block_size=st.sampled_from([8, 16, 32]),
    use_alibi=st.booleans(),
    sliding_window=st.one_of(st.none(), st.integers(1, 70)),
)
def test_prefill_property(
    data: st.DataObject,
    dtype: torch.dtype,
    num_kv_heads: int,
    group: int,
    block_size: int,
    use_alibi: bool,
    sliding_window: int | None,
) -> None:
    # Prompts of up to 70 queries (several tiles of 96 // group rows' queries) after up to 60
    # cached tokens (chunked prefill, prefix hits), in blocks at shuffled ids with NaN
    # in every slot no sequence wrote and garbage in the unused block-table entries.
    cached = data.draw(st.lists(st.integers(0, 60), min_size=1, max_size=2))
    seqs = [(c + q, q) for c, q in ((c, data.draw(st.integers(1 if c == 0 else 0, 70))) for c in cached)]
    if sum(q for _, q in seqs) == 0:
        seqs[0] = (seqs[0][0] + 1, 1)
    seed = data.draw(st.integers(0, 2**31 - 1))
    cfg = (dtype, num_kv_heads * group, num_kv_heads, 64, block_size)
    err = kernel_cases.run_context(numba_attention.context_attention, cfg, seqs, use_alibi, sliding_window, seed)
    assert err < TOLERANCE[dtype]


def test_prefill_never_reads_unused_block_table_entries() -> None:
    query, cache, qsl, lens = _batch([(35, 20), (16, 16)], 6, 2, seed=34)
    table = cache.block_tables.clone()
    table[0, 3:] = -1  # 35 tokens use 3 blocks of 16
    table[1, 1:] = -1
    out = nan_like(query)
    numba_attention.context_attention(out, query, cache.key_cache, cache.value_cache, 2, 0.125, table, qsl, lens, 16)
    expected = ref_context_attention(query, cache.key_cache, cache.value_cache, table, qsl, lens, 0.125)
    assert rel_error(out, expected) < TOLERANCE[torch.float32]


def test_worker_shaped_prefill_matches_the_torch_twin() -> None:
    # SmolLM2's heads (9 query / 3 kv of 64, block 16) and a prefill step of ragged prompts,
    # some after cached context: many work items, several tiles per prompt, partial blocks.
    rng = np.random.default_rng(35)
    seqs = [(int(c + q), int(q)) for c, q in zip(rng.integers(0, 300, 24) * (rng.random(24) < 0.5),
                                                 rng.integers(1, 200, 24))]  # fmt: skip
    query, cache, qsl, lens = _batch(seqs, 9, 3, seed=36)
    for slopes, window in [(None, None), (alibi_slopes_for(9), 100)]:
        args = (cache.key_cache, cache.value_cache, 3, 0.125, cache.block_tables, qsl, lens, 16, slopes, window)
        fast, twin = nan_like(query), nan_like(query)
        numba_attention.context_attention(fast, query, *args)
        cpu_attention.context_attention(twin, query, *args)
        torch.testing.assert_close(fast, twin, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two Numba threads")
def test_prefill_results_do_not_depend_on_the_thread_count() -> None:
    # Threads take work items from a shared queue in whatever order; each item is
    # computed the same way on any thread, so the output is bitwise the same.
    query, cache, qsl, lens = _batch([(300, 250), (90, 40), (64, 64)], 9, 3, seed=37)
    args = (query, cache.key_cache, cache.value_cache, 3, 0.125, cache.block_tables, qsl, lens, 16)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out = nan_like(query)
            numba_attention.context_attention(out, *args)
            assert numba.get_num_threads() == count
            outputs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alibi, window", [(False, 0), (True, 150)])
def test_decode_results_do_not_depend_on_how_items_split_the_heads(dtype: torch.dtype, alibi: bool,
                                                                   window: int) -> None:
    # With sequences enough for its threads the kernel takes each sequence's kv heads as one work item (one read of
    # a block's heads side by side); with few, each kv head of a sequence is an item. The `threads` argument picks
    # the split here (1: 3 sequences are enough; 8: they are not), independently of the machine's cores. Both
    # compute every query head the same way, so the outputs are bitwise the same, and both match the reference.
    # Contexts over 32 blocks of 16 take two spans; 150 under a window starts inside a block.
    lens = [700, 33, 260]
    gen = torch.Generator().manual_seed(41)
    cache = PagedCache(lens, 3, 64, 16, dtype, gen)
    query = torch.randn(len(lens), 9, 64, generator=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    slopes = alibi_slopes_for(9) if alibi else None
    kernel_slopes = np.empty(0, np.float32) if slopes is None else slopes.numpy()
    view = numba_attention._KERNEL_VIEW[dtype]  # the arrays as the worker's calls hand them to the kernel
    keys = numpy_view(cache.key_cache, view, flatten_from=3)
    values = numpy_view(cache.value_cache, view)
    outputs = []
    for threads in (1, 8):
        out = torch.full_like(query, float("nan"))
        _numba_decode.decode_attention(out.numpy(), query.numpy(), keys, values, cache.block_tables.numpy(),
                                       context_lens.numpy(), kernel_slopes, np.float32(0.125), window, threads)
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    expected = ref_paged_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, context_lens,
                                   0.125, slopes, window or None)
    assert rel_error(outputs[0], expected) < TOLERANCE[dtype]


@numba.njit(cache=False)
def _tile_of_heads(acc: np.ndarray, a: np.ndarray, b: np.ndarray, offsets: np.ndarray, width: int, heads: int,
                   count: int, n: int, acc_head: int, a_head: int) -> None:
    # weighted_sums takes its pattern width as a literal, as the decode kernel passes it.
    if width == 4:
        _numba_blocks.weighted_sums(acc, 3, acc_head, a, 5, a_head, width, 4, b, 7, offsets, count, n, heads)
    elif width == 8:
        _numba_blocks.weighted_sums(acc, 3, acc_head, a, 5, a_head, width, 8, b, 7, offsets, count, n, heads)
    else:
        _numba_blocks.weighted_sums(acc, 3, acc_head, a, 5, a_head, width, 16, b, 7, offsets, count, n, heads)


@numba.njit(cache=False)
def _one_head_at_a_time(acc: np.ndarray, a: np.ndarray, b: np.ndarray, offsets: np.ndarray, width: int, heads: int,
                        count: int, n: int, acc_head: int, a_head: int) -> None:
    for h in range(heads):
        _numba_blocks.weighted_sum(acc, 3 + h * acc_head, a, 5 + h * a_head, width, width, b, 7, offsets, count, n)


@pytest.mark.parametrize("width", [4, 8, 16])
@pytest.mark.parametrize("heads", [2, 3, 4])
def test_a_tile_of_heads_sums_exactly_as_one_head_at_a_time(width: int, heads: int) -> None:
    # The decode kernel's GQA tiles (AVX-512) load each key / value row once for several query heads; every
    # head's sums must stay the same chain of multiply-adds as alone, bit for bit, on any CPU.
    rng = np.random.default_rng(width * 10 + heads)
    count, n, acc_head, a_head = 5, 128, 200, 90
    b = rng.standard_normal(4096).astype(np.float32)
    a = rng.standard_normal(5 + heads * a_head + count * width).astype(np.float32)
    offsets = rng.permutation(np.arange(0, 3840, 128))[:count].astype(np.int64)  # rows anywhere, as blocks lie
    start = rng.standard_normal(3 + heads * acc_head + n).astype(np.float32)
    tiled, alone = start.copy(), start.copy()
    _tile_of_heads(tiled, a, b, offsets, width, heads, count, n, acc_head, a_head)
    _one_head_at_a_time(alone, a, b, offsets, width, heads, count, n, acc_head, a_head)
    assert not np.array_equal(alone, start)
    assert np.array_equal(tiled, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 4), (12, 2), (16, 2), (7, 1)])
def test_decode_gqa_groups_match_the_reference(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    # Groups of 2, 6 (two tiles of 3), 8 (two of 4) and 7 (no tile: one head at a time) with 16-slot blocks, the
    # shapes the kernel tiles on AVX-512; contexts of one block, of several with a partly used last block, and of
    # two spans.
    cfg = (dtype, num_heads, num_kv_heads, 64, 16)
    for alibi, window in [(False, None), (True, 40)]:
        error = kernel_cases.run_paged(numba_attention.paged_attention, cfg, [16, 45, 600, 1], alibi, window, 7)
        assert error < TOLERANCE[dtype]


@pytest.mark.parametrize("group, window", [(1, 0), (3, 0), (3, 50)])
def test_plan_tiles_cover_every_query_once_most_expensive_first(group: int, window: int) -> None:
    starts = np.array([0, 200, 200, 205, 301], dtype=np.int32)
    lengths = np.array([200, 17, 500, 96], dtype=np.int32)  # the second sequence has no queries
    tiles, size = _numba_prefill.plan_tiles(starts, lengths, 2, group, window)
    covered = np.zeros((starts[-1], 2), dtype=int)
    spans = []
    for b, h, t0, t1 in tiles.tolist():
        assert 0 < t1 - t0 <= max(1, 96 // group)
        covered[starts[b] + t0 : starts[b] + t1, h] += 1
        end = lengths[b] - (starts[b + 1] - starts[b]) + t1
        spans.append(group * (t1 - t0) * (end - (0 if window == 0 else max(0, end - (t1 - t0) - window + 1))))
    assert (covered == 1).all()
    assert spans == sorted(spans, reverse=True)
    assert size == sum(spans)
