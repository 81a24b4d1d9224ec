"""CacheEngine block operations: swaps (synchronous on a CPU, a side stream on a GPU) and copies."""

from __future__ import annotations

import pytest
import torch

from llmserve import kernels
from worker_service.cache_engine import CacheEngine, CacheSizing
from worker_service.model_loader import ModelShape

SHAPE = ModelShape(num_layers=3, num_heads=4, num_kv_heads=2, head_size=16, vocab_size=64,
                   max_position_embeddings=64)  # fmt: skip


def make_engine(device: torch.device) -> CacheEngine:
    engine = CacheEngine(SHAPE, CacheSizing(num_gpu_blocks=6, num_cpu_blocks=4), 4, torch.float32, device,
                         kernels.get_backend(device))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for cache in engine.key_caches + engine.value_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return engine


def swap_round_trip(engine: CacheEngine) -> None:
    """Swap blocks 1, 4 out, clobber them on the device, swap them back into 0, 5; check every layer."""
    before = [c.clone() for c in engine.key_caches + engine.value_caches]
    engine.swap_out([(1, 2), (4, 0)])
    for layer in range(SHAPE.num_layers):
        engine.wait_for_layer(layer)  # the next writes reuse the swapped-out blocks
        engine.key_caches[layer][[1, 4]] = 0
        engine.value_caches[layer][[1, 4]] = 0
    engine.swap_in([(2, 0), (0, 5)])
    for layer in range(SHAPE.num_layers):
        engine.wait_for_layer(layer)
        for cache, old in ((engine.key_caches[layer], before[layer]),
                           (engine.value_caches[layer], before[SHAPE.num_layers + layer])):  # fmt: skip
            assert torch.equal(cache[0], old[1]) and torch.equal(cache[5], old[4])
            assert not cache[1].any() and not cache[4].any()
            assert torch.equal(cache[[2, 3]], old[[2, 3]])


def test_cpu_swaps_are_synchronous_and_exact() -> None:
    engine = make_engine(torch.device("cpu"))
    swap_round_trip(engine)


def test_copy_and_swap_reject_out_of_range_pairs() -> None:
    engine = make_engine(torch.device("cpu"))
    before = engine.key_caches[2].clone()
    engine.copy([(3, 1)])
    assert torch.equal(engine.key_caches[2][1], before[3])
    with pytest.raises(ValueError, match=r"swap_in pair \(4, 0\) is out of range \(4 -> 6 blocks\)"):
        engine.swap_in([(4, 0)])
    with pytest.raises(ValueError, match=r"copy pair \(0, 6\)"):
        engine.copy([(0, 6)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_swaps_run_on_the_side_stream_and_layers_wait_for_them() -> None:
    engine = make_engine(torch.device("cuda"))
    assert engine.cpu_key_caches[0].is_pinned()
    swap_round_trip(engine)
    # A copy reads every layer at once, so it waits for all of the step's swaps.
    engine.swap_in([(2, 1)])
    engine.copy([(1, 3)])
    for layer in range(SHAPE.num_layers):
        assert torch.equal(engine.key_caches[layer][3].cpu(), engine.cpu_key_caches[layer][2])
