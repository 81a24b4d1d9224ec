"""KV-cache sizing: vLLM's GPU rule on measured numbers, the CPU budget, start-up errors, the profiling step.

The GPU numbers are fake (this runs without a GPU): sizing is a pure function
of what the profiler measures. The profiling step itself runs here on a CPU,
through the paged attention, on a tiny random model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from llmserve import kernels
from worker_service.cache_engine import CacheSizeError, MemoryProfile, block_bytes, gpu_cache_bytes, size_cache
from worker_service.config import WorkerConfig
from worker_service.model_loader import ModelShape, model_shape
from worker_service.models import build_model
from worker_service.profiler import profile_num_tokens, profile_step

GIB = 1 << 30
# 32 layers x 8 kv heads x 128 dims: 2 * 32 * 8 * 128 * 16 tokens * 2 bytes = 2 MiB per fp16 block of 16.
SHAPE = ModelShape(num_layers=32, num_heads=32, num_kv_heads=8, head_size=128, vocab_size=32000,
                   max_position_embeddings=4096)  # fmt: skip


def test_block_bytes() -> None:
    assert block_bytes(SHAPE, 16, torch.float16) == 2 << 20
    assert block_bytes(SHAPE, 16, torch.float32) == 4 << 20


def test_gpu_cache_gets_utilization_of_total_minus_peak() -> None:
    # 80 GiB device, 0.9 of it allowed (72 GiB), 16 GiB peak: 56 GiB for the cache.
    profile = MemoryProfile(total_bytes=80 * GIB, peak_bytes=16 * GIB, num_tokens=4096)
    budget = gpu_cache_bytes(profile, 0.9)
    assert budget == int(80 * GIB * 0.9) - 16 * GIB
    sizing = size_cache(SHAPE, 16, torch.float16, budget, 4 * GIB, 4096, memory_flag="--gpu-memory-utilization")
    assert sizing.num_gpu_blocks == budget // (2 << 20) == 28672
    assert sizing.num_cpu_blocks == 2048  # --swap-space 4 GiB / 2 MiB


def test_gpu_too_small_for_the_model_fails_with_the_numbers() -> None:
    profile = MemoryProfile(total_bytes=16 * GIB, peak_bytes=9 * GIB, num_tokens=2048)
    with pytest.raises(CacheSizeError) as info:
        gpu_cache_bytes(profile, 0.5)
    message = str(info.value)
    assert "2048-token step peaks at 9.00 GiB" in message
    assert "--gpu-memory-utilization=0.5 allows 8.00 GiB of the device's 16.00 GiB" in message


def test_gpu_too_small_for_one_sequence_names_the_gpu_flag() -> None:
    # 100 MiB left: 50 blocks of 16 tokens, fewer than the 256 blocks of a 4096-token sequence.
    budget = gpu_cache_bytes(MemoryProfile(total_bytes=10 * GIB, peak_bytes=9 * GIB - 100 * (1 << 20), num_tokens=4096), 0.9)
    with pytest.raises(CacheSizeError, match=r"holds 50 blocks .* needs \(256 blocks\).*--gpu-memory-utilization"):
        size_cache(SHAPE, 16, torch.float16, budget, 0, 4096, memory_flag="--gpu-memory-utilization")


def test_cpu_cache_comes_from_kv_cache_memory() -> None:
    sizing = size_cache(SHAPE, 16, torch.float32, 1 * GIB, 0, 4096)
    assert (sizing.num_gpu_blocks, sizing.num_cpu_blocks) == (256, 0)
    with pytest.raises(CacheSizeError, match=r"holds 255 blocks .*--kv-cache-memory"):
        size_cache(SHAPE, 16, torch.float32, GIB - 1, 0, 4096)


def test_override_wins_over_memory() -> None:
    assert size_cache(SHAPE, 16, torch.float16, 0, 0, 64, num_gpu_blocks_override=4).num_gpu_blocks == 4


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_config_rejects_gpu_memory_utilization_outside_0_1(tmp_path, utilization: float) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=f"gpu_memory_utilization must be in \\(0, 1\\], got {utilization}"):
        WorkerConfig(model=str(tmp_path), gpu_memory_utilization=utilization)


def test_profile_steps_the_scheduler_default_budget() -> None:
    assert profile_num_tokens(256) == 2048
    assert profile_num_tokens(8192) == 8192


def test_profile_step_runs_the_largest_step_through_the_paged_attention(tmp_path: Path) -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = build_model(config, str(tmp_path), torch.float32, torch.device("cpu"), 64)
    shape = model_shape(config)
    cpu = kernels.get_backend("cpu")
    calls: list[tuple[int, list[int]]] = []

    def context_attention(out: torch.Tensor, query: torch.Tensor, *args: object, **kwargs: object) -> None:
        calls.append((query.shape[0], args[6].tolist()))  # type: ignore[attr-defined]  # seq_lens
        cpu.context_attention(out, query, *args, **kwargs)  # type: ignore[arg-type]

    spy = dataclasses.replace(cpu, context_attention=context_attention)
    # 40 tokens, sequences of at most 16: 16 + 16 + 8, in 2 + 2 + 1 blocks of 8.
    cache_bytes = profile_step(model, spy, shape, torch.float32, torch.device("cpu"), 8, 40, 16)
    assert cache_bytes == 5 * block_bytes(shape, 8, torch.float32)
    assert calls == [(40, [16, 16, 8])] * config.num_hidden_layers
