"""The Numba-CUDA kernels on a real GPU, at the shapes models serve with, against the float64 references.

tests/unit/test_kernels_cuda.py runs the same kernels under numba's CUDA simulator, at tiny shapes (the
simulator runs each CUDA thread as a Python thread). Here they run compiled for the device: real warps
and shuffles, real shared-memory limits, the partitioned kernel on contexts of thousands of tokens,
grids of thousands of blocks, and DMA swaps between device and pinned host memory.

Skipped without a CUDA device (CI has none); run as its own process (`pytest tests/gpu`), since numba
chooses between the simulator and the GPU once per process.
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from numba import cuda  # noqa: E402

if cuda.jit.__module__.startswith("numba.cuda.simulator"):
    pytest.skip("numba.cuda runs the simulator in this process; run tests/gpu on its own", allow_module_level=True)

from llmserve import kernels  # noqa: E402
import llmserve.kernels.cuda as kcuda  # noqa: E402
from llmserve.kernels.cuda import attention  # noqa: E402
from tests import kernel_cases  # noqa: E402
from tests.kernel_cases import TOLERANCE, cache_write_case, config_id, feature_id, stable_seed  # noqa: E402

GPU = torch.device("cuda")


def on_gpu(kernel):  # -> a kernel taking CPU tensors, as tests/kernel_cases.py builds them
    """Runs ``kernel`` on copies of its tensor arguments on the GPU and writes its output (first argument) back."""

    def run(out: torch.Tensor, *args: object, **kwargs: object) -> None:
        def move(a: object) -> object:
            return a.to(GPU) if isinstance(a, torch.Tensor) else a

        out_gpu = out.to(GPU)
        kernel(out_gpu, *(move(a) for a in args), **{k: move(v) for k, v in kwargs.items()})
        torch.cuda.synchronize()
        out.copy_(out_gpu.cpu())

    return run


def ragged(batch: int, longest: int, seed: int) -> list[int]:
    """Context lengths from 1 to ``longest``: the longest, a one-token context, and random ones between."""
    rng = random.Random(seed)
    return [longest, 1] + [rng.randint(1, longest) for _ in range(batch - 2)]


# (dtype, num_heads, num_kv_heads, head_size, block_size): the default model (SmolLM2-135M: GQA 9/3, d64),
# Llama-3-8B (GQA 32/8, d128), Qwen2-0.5B's d64 with 14/2 heads, an MHA model with d80, blocks of 8 and 32.
MODELS = [
    (torch.float32, 9, 3, 64, 16),
    (torch.float16, 9, 3, 64, 16),
    (torch.bfloat16, 32, 8, 128, 16),
    (torch.float16, 32, 8, 128, 32),
    (torch.bfloat16, 14, 2, 64, 8),
    (torch.float32, 16, 16, 80, 16),
]
# (batch, longest context): a full decode batch (not partitioned), few long sequences (partitioned),
# one sequence past MAX_UNPARTITIONED_CONTEXT (partitioned whatever the grid).
SHAPES = [(64, 1024), (4, 4096), (1, 9000)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{b}-ctx{c}" for b, c in SHAPES])
@pytest.mark.parametrize("cfg", MODELS, ids=[config_id(c) for c in MODELS])
def test_paged_attention_on_the_gpu_matches_reference(cfg: tuple, shape: tuple) -> None:
    batch, longest = shape
    seed = stable_seed("gpu", config_id(cfg), str(shape))
    err = kernel_cases.run_paged(on_gpu(kcuda.paged_attention), cfg, ragged(batch, longest, seed), False, None, seed,
                                   dense=True)
    assert err < TOLERANCE[cfg[0]]


@pytest.mark.parametrize(
    ("cfg", "feature"),
    [((torch.float32, 8, 8, 128, 16), (True, None)), ((torch.bfloat16, 32, 8, 128, 16), (False, 4096)),
     ((torch.float16, 9, 3, 64, 32), (True, 1000))],
    ids=lambda v: config_id(v) if isinstance(v[0], torch.dtype) else feature_id(v),
)
def test_alibi_and_sliding_windows_on_the_gpu(cfg: tuple, feature: tuple) -> None:
    # Partitioned (few long rows) and not (a full batch): a window skips whole partitions in the first.
    for batch, longest in ((3, 6000), (48, 1500)):
        seed = stable_seed("gpu-features", config_id(cfg), feature_id(feature), str(batch))
        err = kernel_cases.run_paged(on_gpu(kcuda.paged_attention), cfg, ragged(batch, longest, seed), *feature, seed,
                                       dense=True)
        assert err < TOLERANCE[cfg[0]], (batch, longest)


def test_the_partition_rule_picks_both_kernels_at_these_shapes() -> None:
    # The cases above exercise what they claim: SHAPES[0] runs unpartitioned, the others partitioned.
    assert attention.partition_size_for(64, 9, 1024, 16) == 0
    assert attention.partition_size_for(4, 9, 4096, 16) > 0
    assert attention.partition_size_for(1, 32, 9000, 16) > 0


# (seq_len, q_len): a long prompt computed whole, a chunk after 3000 cached tokens, a batch of short
# prompts, one-token prompts and a decode-like single query after a long context.
CONTEXT_CASES = {
    "long-prompt": [(2048, 2048)],
    "chunk-after-cache": [(3512, 512), (700, 100)],
    "short-prompts": [(n, n) for n in (5, 17, 33, 64, 100, 128, 1, 250)],
    "one-query-after-context": [(5000, 1), (1, 1)],
}


@pytest.mark.parametrize("seqs", CONTEXT_CASES.values(), ids=CONTEXT_CASES.keys())
@pytest.mark.parametrize("cfg", [MODELS[0], MODELS[2]], ids=[config_id(MODELS[0]), config_id(MODELS[2])])
def test_context_attention_on_the_gpu_matches_reference(cfg: tuple, seqs: list[tuple[int, int]]) -> None:
    seed = stable_seed("gpu-ctx", config_id(cfg), str(seqs))
    err = kernel_cases.run_context(on_gpu(kcuda.context_attention), cfg, seqs, False, None, seed, dense=True)
    assert err < TOLERANCE[cfg[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_on_the_gpu_is_exact(dtype: torch.dtype) -> None:
    case = cache_write_case(dtype, 2048, 8, 128, 16, num_tokens=8192, padding=list(range(0, 8192, 97)), seed=31,
                            dense=True)
    k_gpu, v_gpu, kv = case.key_cache.to(GPU), case.value_cache.to(GPU), case.kv.to(GPU)
    kcuda.reshape_and_cache(kv[:, 0], kv[:, 1], k_gpu, v_gpu, case.slot_mapping.to(GPU))
    assert torch.equal(k_gpu.cpu().view(torch.uint8), case.expected_key_cache.view(torch.uint8))
    assert torch.equal(v_gpu.cpu().view(torch.uint8), case.expected_value_cache.view(torch.uint8))


def test_copy_blocks_on_the_gpu_is_exact_in_every_layer() -> None:
    gen = torch.Generator(device=GPU).manual_seed(32)
    layers, num_blocks = 40, 512  # more layers than one launch takes
    keys, values = kernels.allocate_kv_cache(layers, num_blocks, 8, 128, 16, torch.bfloat16, GPU)
    for c in keys + values:
        c.normal_(generator=gen)
    before = [c.clone() for c in keys + values]
    src = torch.randperm(num_blocks // 2, device=GPU)[:100]
    dst = num_blocks // 2 + torch.randperm(num_blocks // 2, device=GPU)[:100]
    kcuda.copy_blocks(keys, values, torch.stack([src, dst], dim=1).cpu())
    for cache, old in zip(keys + values, before):
        expected = old.clone()
        expected[dst] = old[src]
        assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))


def test_swaps_between_the_gpu_and_pinned_memory_are_exact() -> None:
    layers, gpu_blocks, cpu_blocks = 4, 256, 128
    gpu_keys, gpu_values = kernels.allocate_kv_cache(layers, gpu_blocks, 8, 128, 16, torch.float16, GPU)
    cpu_keys, cpu_values = kernels.allocate_kv_cache(layers, cpu_blocks, 8, 128, 16, torch.float16, "cpu",
                                                     pin_memory=True)
    for c in gpu_keys + gpu_values:
        c.normal_()
    # Out: a run of consecutive blocks and scattered ones; back in at other GPU blocks.
    out_pairs = [[10 + i, 3 + i] for i in range(20)] + [[200, 100], [7, 127], [255, 0]]
    swapper = kcuda.LayerSwapper(layers, GPU)
    swapper.swap(gpu_keys, gpu_values, cpu_keys, cpu_values, torch.tensor(out_pairs))
    swapper.synchronize()
    for gpu, host in zip(gpu_keys + gpu_values, cpu_keys + cpu_values):
        for src, dst in out_pairs:
            assert torch.equal(host[dst], gpu[src].cpu())
    in_pairs = [[dst, 128 + i] for i, (_, dst) in enumerate(out_pairs)]
    for gpu, host in zip(gpu_keys + gpu_values, cpu_keys + cpu_values):
        kcuda.swap_blocks(host, gpu, torch.tensor(in_pairs))
    torch.cuda.synchronize()
    for gpu in gpu_keys + gpu_values:
        for (src, _), (_, dst) in zip(out_pairs, in_pairs):
            assert torch.equal(gpu[dst], gpu[src])
