"""The scheduling policy a worker gets when the flags leave it open: chunked prefill by the worker's device."""

from __future__ import annotations

import pytest

from llmserve.offline import _SCHEDULER_ARGS, _flags
from protos import worker_pb2
from scheduler_service.scheduling import SchedulingFlags, scheduler_for
from shared.defaults import CPU_STEP_BUDGET


def _worker(device: str, max_model_len: int = 4096) -> worker_pb2.WorkerDescription:
    return worker_pb2.WorkerDescription(device=device, block_size=16, num_gpu_blocks=64, max_model_len=max_model_len)


@pytest.mark.parametrize(("device", "chunked", "budget"), [
    ("cpu", True, CPU_STEP_BUDGET),
    ("cuda", False, 4096),
    ("cuda:1", False, 4096),
    ("simulated h100", False, 4096),
])
def test_unset_flags_chunk_prompts_only_for_cpu_workers(device: str, chunked: bool, budget: int) -> None:
    config = scheduler_for(SchedulingFlags(), _worker(device)).scheduler_config
    assert (config.enable_chunked_prefill, config.max_num_batched_tokens) == (chunked, budget)


def test_a_short_model_keeps_a_2048_token_step_without_chunking() -> None:
    assert scheduler_for(SchedulingFlags(), _worker("cuda", 512)).scheduler_config.max_num_batched_tokens == 2048


@pytest.mark.parametrize(("flags", "device", "chunked", "budget"), [
    (SchedulingFlags(enable_chunked_prefill=False), "cpu", False, 4096),
    (SchedulingFlags(enable_chunked_prefill=True), "cuda", True, 512),
    (SchedulingFlags(max_num_batched_tokens=1024), "cpu", True, 1024),
    (SchedulingFlags(enable_chunked_prefill=True, max_num_batched_tokens=64), "cuda", True, 64),
])
def test_the_flags_win_over_the_device(flags: SchedulingFlags, device: str, chunked: bool, budget: int) -> None:
    config = scheduler_for(flags, _worker(device)).scheduler_config
    assert (config.enable_chunked_prefill, config.max_num_batched_tokens) == (chunked, budget)


def test_offline_services_get_an_explicit_off() -> None:
    """LLM(services=True, enable_chunked_prefill=False) must turn it off on a CPU worker, not fall back to on."""
    assert _flags({"enable_chunked_prefill": False, "max_num_seqs": 4}, _SCHEDULER_ARGS) == [
        "--no-enable-chunked-prefill", "--max-num-seqs", "4"]
    assert _flags({"enable_chunked_prefill": True}, _SCHEDULER_ARGS) == ["--enable-chunked-prefill"]
    assert _flags({"enable_chunked_prefill": None, "enable_prefix_caching": False}, _SCHEDULER_ARGS) == []
