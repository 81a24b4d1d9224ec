"""Numba-CUDA kernels under numba's CUDA simulator, against the float64 references.

No GPU needed: ``NUMBA_ENABLE_CUDASIM=1`` must be set before ``numba.cuda`` is
first imported, which this module does at import time (pytest imports every
test module before running any test). numba picks the simulator or the GPU
once per process, so a GPU run of these kernels needs a process of its own.

The simulator runs every CUDA thread as a Python thread (~0.2 s per thread
block of 128), so shapes are tiny: 2 heads, 3 sequences, contexts <= 40.
Cases come from tests/kernel_cases.py, as for the CPU kernels: NaN-poisoned caches
and outputs, permuted block tables, ragged contexts (one token, non-multiples of
the block size).
"""

from __future__ import annotations

import functools
import os
import sys

if "numba.cuda" not in sys.modules:
    # Set only while numba reads its configuration, so that subprocesses
    # started by other tests (workers on a GPU machine) do not inherit it.
    _previous = os.environ.get("NUMBA_ENABLE_CUDASIM")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    import numba

    numba.config.reload_config()
    import numba.cuda  # noqa: F401

    if _previous is None:
        del os.environ["NUMBA_ENABLE_CUDASIM"]
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = _previous

import numba  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from numba import cuda  # noqa: E402

if not cuda.jit.__module__.startswith("numba.cuda.simulator"):
    pytest.skip(
        "numba.cuda was initialised for a real GPU earlier in this process; run this file on its own",
        allow_module_level=True,
    )

from llmserve import kernels  # noqa: E402
import llmserve.kernels.cuda as kcuda  # noqa: E402
from llmserve.kernels.cuda import _dtypes, _warp, attention, cache_ops  # noqa: E402
from llmserve.kernels.cuda._device import SIMULATOR  # noqa: E402
from tests import kernel_cases  # noqa: E402
from tests.kernel_cases import (  # noqa: E402
    TOLERANCE,
    PagedCache,
    cache_write_case,
    config_id,
    feature_id,
    rel_error,
    stable_seed,
)
from tests.kernels_reference import ref_paged_attention  # noqa: E402

assert SIMULATOR, "kernels.cuda must run under the simulator in this test module"


@pytest.fixture(autouse=True, scope="module")
def _fast_thread_switches():
    # The simulator's block manager busy-polls its 128 threads while they wait
    # at barriers; with the default 5 ms switch interval it holds the GIL for
    # whole slices at a time. Switching more often makes these tests ~1.5x faster.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-3)
    yield
    sys.setswitchinterval(previous)


# (dtype, num_heads, num_kv_heads, head_size, block_size): every dtype, head size and block size;
# GQA (4/2), MQA (2/1) and MHA (2/2).
CONFIGS = [
    (torch.float32, 4, 2, 64, 16),
    (torch.float32, 2, 2, 80, 8),
    (torch.float32, 2, 1, 96, 32),
    (torch.float32, 2, 1, 128, 16),
    (torch.float16, 2, 1, 64, 8),
    (torch.float16, 2, 2, 96, 32),
    (torch.bfloat16, 2, 1, 64, 16),
    (torch.bfloat16, 2, 1, 128, 8),
]
# (use_alibi, sliding_window), one per config above: windows below, within and across blocks.
FEATURES = [(False, None), (True, None), (False, 11), (True, 7), (False, 11), (False, None), (True, None), (True, 7)]


run_paged = functools.partial(kernel_cases.run_paged, kcuda.paged_attention)
run_context = functools.partial(kernel_cases.run_context, kcuda.context_attention)


# ---------------------------------------------------------------- decode attention


@pytest.mark.parametrize(
    ("cfg", "feature"),
    list(zip(CONFIGS, FEATURES)),
    ids=[f"{config_id(c)}-{feature_id(f)}" for c, f in zip(CONFIGS, FEATURES)],
)
def test_paged_attention_matches_reference(cfg: tuple, feature: tuple) -> None:
    block_size = cfg[4]
    # One token, one past a block, and 40 (not a block multiple; 5 blocks of 8 > 4 warps).
    seed = stable_seed("cuda", config_id(cfg), feature_id(feature))
    err = run_paged(cfg, [1, block_size + 1, 40], *feature, seed=seed)
    assert err < TOLERANCE[cfg[0]]


@pytest.mark.parametrize(
    ("cfg", "feature"),
    [((torch.float32, 1, 1, 64, 8), (True, 11)), ((torch.bfloat16, 1, 1, 64, 16), (False, None))],
    ids=["fp32-alibi-win11", "bf16"],
)
def test_partitioned_paged_attention_matches_reference(
    monkeypatch: pytest.MonkeyPatch, cfg: tuple, feature: tuple
) -> None:
    # 16-position partitions: a 40-token context spans 3, the window skips the first one,
    # and an empty context has none (the reduce kernel writes its zeros).
    monkeypatch.setattr(attention, "PARTITION_SIZE", 16)
    assert attention.partition_size_for(3, cfg[1], 40, cfg[4]) == 16
    err = run_paged(cfg, [0, 17, 40], *feature, seed=stable_seed("cuda-partitioned", config_id(cfg)))
    assert err < TOLERANCE[cfg[0]]


@pytest.mark.parametrize(
    ("num_rows", "num_heads", "longest", "block_size", "expected"),
    [
        (1, 32, 512, 16, 0),  # one partition: nothing to split
        (1, 32, 513, 16, 512),  # long context, small grid
        (16, 32, 4096, 16, 512),  # 512 blocks: still too few for the GPU
        (17, 32, 4096, 16, 0),  # enough blocks without partitions
        (64, 32, 8193, 16, 512),  # scores would not fit shared memory
        (1, 1, 600, 24, 528),  # partitions hold whole blocks
    ],
)
def test_partition_rule(num_rows: int, num_heads: int, longest: int, block_size: int, expected: int) -> None:
    assert attention.partition_size_for(num_rows, num_heads, longest, block_size) == expected


def test_paged_attention_zero_context_strided_views_and_untouched_neighbours() -> None:
    gen = torch.Generator().manual_seed(7)
    cache = PagedCache([5, 0, 12], 1, 64, 8, torch.float32, gen)
    fused = torch.randn(3, 3, 2, 64, generator=gen)  # [S, q/k/v, H, D]: query is a strided view
    query = fused[:, 0]
    out_buffer = torch.full((3, 2, 2, 64), float("nan"))
    out = out_buffer[:, :, 1]
    lens = torch.tensor([5, 0, 12], dtype=torch.int32)
    kcuda.paged_attention(out, query, cache.key_cache, cache.value_cache, 1, 0.125, cache.block_tables, lens, 8, 12)
    expected = ref_paged_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, lens, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_error(out, expected) < TOLERANCE[torch.float32]
    assert torch.isnan(out_buffer[:, :, 0]).all()


# ---------------------------------------------------------------- prefill attention

# (seq_len, q_len): a chunk after a cached prefix crossing a block boundary, a
# one-token prompt, one new token after a prefix, a sequence with no queries.
CONTEXT_SEQS = [(11, 3), (1, 1), (9, 1), (5, 0)]


@pytest.mark.parametrize(
    ("cfg", "feature"),
    [
        ((torch.float32, 2, 1, 64, 8), (False, None)),
        ((torch.float32, 2, 1, 64, 8), (True, 4)),
        ((torch.float16, 2, 1, 80, 16), (False, None)),
        ((torch.bfloat16, 2, 1, 64, 8), (True, None)),
    ],
    ids=["fp32", "fp32-alibi-win4", "fp16-d80", "bf16-alibi"],
)
def test_context_attention_matches_reference(cfg: tuple, feature: tuple) -> None:
    err = run_context(cfg, CONTEXT_SEQS, *feature, seed=stable_seed("cuda-ctx", config_id(cfg), feature_id(feature)))
    assert err < TOLERANCE[cfg[0]]


def test_context_attention_partitioned(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two queries after a 38-token prefix read three 16-position partitions.
    monkeypatch.setattr(attention, "PARTITION_SIZE", 16)
    err = run_context((torch.float32, 1, 1, 64, 8), [(40, 2)], True, 30, seed=21)
    assert err < TOLERANCE[torch.float32]


# ---------------------------------------------------------------- cache ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    case = cache_write_case(dtype, 4, 2, 32, 8, num_tokens=6, padding=[0, 4], seed=10)
    kcuda.reshape_and_cache(case.key, case.value, case.key_cache, case.value_cache, case.slot_mapping)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(case.key_cache.view(bits), case.expected_key_cache.view(bits))
    assert torch.equal(case.value_cache, case.expected_value_cache)


def _random_layers(layers: int, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    sizes = (8, 2, 16, 4, torch.float16)
    keys = [torch.randn(kernels.key_cache_shape(*sizes), generator=gen).half() for _ in range(layers)]
    values = [torch.randn(kernels.value_cache_shape(*sizes), generator=gen).half() for _ in range(layers)]
    return keys, values


@pytest.mark.parametrize(
    ("mapping", "caches_per_launch"),
    [
        ([[2, 5], [3, 7], [0, 1]], 64),  # disjoint: one kernel launch
        ([[2, 5], [3, 7], [0, 1]], 4),  # 3 layers = 6 caches in launches of 4
        ([[2, 5], [3, 7], [5, 1]], 64),  # block 5 is a source and a destination: sources read first
    ],
    ids=["one-launch", "chunked-launches", "overlapping"],
)
def test_copy_blocks_is_exact_for_every_layer(
    monkeypatch: pytest.MonkeyPatch, mapping: list[list[int]], caches_per_launch: int
) -> None:
    monkeypatch.setattr(cache_ops, "_CACHES_PER_LAUNCH", caches_per_launch)
    key_caches, value_caches = _random_layers(3, torch.Generator().manual_seed(11))
    before = [c.clone() for c in key_caches + value_caches]
    kcuda.copy_blocks(key_caches, value_caches, torch.tensor(mapping))
    for cache, old in zip(key_caches + value_caches, before):
        expected = old.clone()
        for src, dst in mapping:
            expected[dst] = old[src]
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("same_buffer", [False, True])
def test_swap_blocks_is_exact(same_buffer: bool) -> None:
    gen = torch.Generator().manual_seed(12)
    src = torch.randn(kernels.key_cache_shape(6, 2, 32, 8, torch.bfloat16), generator=gen).bfloat16()
    dst = src if same_buffer else torch.randn(kernels.key_cache_shape(4, 2, 32, 8, torch.bfloat16), generator=gen)
    dst = dst.bfloat16()
    src_before, expected = src.clone(), dst.clone()
    # A run of consecutive blocks (0, 1 -> 2, 3) and a lone block; in one buffer block 2 is read and written.
    mapping = torch.tensor([[1, 3], [5, 0], [0, 2]])
    kcuda.swap_blocks(src, dst, mapping)
    for s, d in mapping.tolist():
        expected[d] = src_before[s]
    assert torch.equal(dst, expected)
    if not same_buffer:
        assert torch.equal(src, src_before)


def test_layer_swapper_copies_every_layer_and_checks_layers() -> None:
    gen = torch.Generator().manual_seed(13)
    gpu_keys, gpu_values = _random_layers(2, gen)
    cpu_keys, cpu_values = _random_layers(2, gen)
    swapper = kcuda.LayerSwapper(2, "cpu")
    mapping = torch.tensor([[0, 6], [4, 2]])
    swapper.swap(gpu_keys, gpu_values, cpu_keys, cpu_values, mapping)
    for layer in range(2):
        swapper.wait(layer)
        for src, dst in ((gpu_keys, cpu_keys), (gpu_values, cpu_values)):
            assert torch.equal(dst[layer][6], src[layer][0]) and torch.equal(dst[layer][2], src[layer][4])
    swapper.synchronize()
    with pytest.raises(ValueError, match="layer"):
        swapper.wait(2)
    with pytest.raises(ValueError, match="num_layers"):
        swapper.swap(gpu_keys[:1], gpu_values, cpu_keys, cpu_values, mapping)


# ---------------------------------------------------------------- building blocks and API


def test_bf16_conversions_match_torch() -> None:
    # Every bf16 bit pattern widens exactly.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    widened = torch.tensor([float(_dtypes.bf16_to_f32(np.int16(b))) for b in bits.tolist()], dtype=torch.float32)
    expected = bits.view(torch.bfloat16).float()
    assert torch.equal(widened.isnan(), expected.isnan())
    assert torch.equal(widened[~expected.isnan()], expected[~expected.isnan()])
    # Narrowing rounds to nearest even like torch: ties both ways, overflow to inf, subnormals, signed zero.
    gen = torch.Generator().manual_seed(14)
    edge = [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.4e38, -3.4e38, 1e-40, -1e-40, float("inf")]
    values = torch.cat([torch.tensor(edge), torch.randn(2000, generator=gen) * 10.0 ** torch.randint(-30, 30, (2000,))])
    narrowed = torch.tensor([int(_dtypes.f32_to_bf16(np.float32(v))) for v in values.tolist()], dtype=torch.int16)
    assert torch.equal(narrowed, values.to(torch.bfloat16).view(torch.int16))
    assert int(_dtypes.f32_to_bf16(np.float32("nan"))) == 0x7FC0


def test_simulated_warp_shuffles() -> None:
    @cuda.jit
    def reduce_kernel(sums, maxes, broadcast):
        tid = cuda.threadIdx.x
        value = np.float32(tid % 32)
        sums[tid] = _warp.xor_sum(value, 8)
        maxes[tid] = _warp.xor_max(value, 32)
        broadcast[tid] = _warp.shfl_sync(_warp.FULL_MASK, value + np.float32(tid // 32), 3)

    sums, maxes, broadcast = (np.zeros(64, np.float32) for _ in range(3))
    reduce_kernel[1, 64](sums, maxes, broadcast)
    lane = np.arange(64) % 32
    assert np.array_equal(sums, (lane // 8 * 8 * 8 + 28).astype(np.float32))  # sum of each group of 8 lanes
    assert np.array_equal(maxes, np.full(64, 31, np.float32))
    assert np.array_equal(broadcast, (3 + np.arange(64) // 32).astype(np.float32))


def test_get_backend_returns_the_cuda_kernels() -> None:
    backend = kernels.get_backend("cuda")
    assert backend.name == "cuda"
    assert backend.paged_attention is kcuda.paged_attention
    assert backend.context_attention is kcuda.context_attention
    assert backend.reshape_and_cache is kcuda.reshape_and_cache
    assert backend.copy_blocks is kcuda.copy_blocks
    assert backend.swap_blocks is kcuda.swap_blocks


def _decode_call(**change) -> None:
    gen = torch.Generator().manual_seed(15)
    cache = PagedCache([5, 12], 1, 64, 8, torch.float32, gen)
    query = torch.randn(2, 2, 64, generator=gen)
    args = dict(
        out=torch.empty_like(query), query=query, key_cache=cache.key_cache, value_cache=cache.value_cache,
        num_kv_heads=1, scale=0.125, block_tables=cache.block_tables,
        context_lens=torch.tensor([5, 12], dtype=torch.int32), block_size=8, max_context_len=12,
    )  # fmt: skip
    args.update(change)
    kcuda.paged_attention(**args)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(out=torch.empty(2, 2, 64, dtype=torch.float64)), "dtype"),
        (dict(context_lens=torch.tensor([5, 13], dtype=torch.int32)), "max_context_len"),
        (dict(block_tables=torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)), "block ids"),
        (dict(block_tables=torch.tensor([[0], [1]], dtype=torch.int32)), "columns"),
    ],
    ids=["float64-out", "context-over-max", "block-id-out-of-range", "table-too-narrow"],
)
def test_paged_attention_rejects_invalid_arguments(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _decode_call(**change)


def test_attention_rejects_block_size_not_dividing_the_warp() -> None:
    gen = torch.Generator().manual_seed(16)
    cache = PagedCache([5], 1, 64, 64, torch.float32, gen)
    query = torch.randn(1, 1, 64, generator=gen)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size must divide 32"):
        kcuda.paged_attention(query.clone(), query, cache.key_cache, cache.value_cache, 1, 0.1, cache.block_tables,
                              lens, 64, 5)  # fmt: skip
