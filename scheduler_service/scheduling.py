"""The scheduling policy's flags and the scheduler they build for a worker, with their defaults.

Shared by the scheduler service (SchedulerServiceConfig extends the flags) and the in-process engine
of the offline API (llmserve/engine.py), so that both schedule alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import worker_pb2
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from shared import defaults


@dataclass(kw_only=True)
class SchedulingFlags:
    """--max-num-seqs, --max-num-batched-tokens, --max-model-len, --enable-chunked-prefill, --enable-prefix-caching.

    enable_chunked_prefill None: by the worker's device, on for a CPU worker, else off (scheduler_for);
    max_num_batched_tokens None: defaults.CPU_STEP_BUDGET for a CPU worker with chunked prefill, else vLLM's default
    (512 with chunked prefill, max(max_model_len, 2048) without); max_model_len 0: the worker's.
    """

    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    max_model_len: int = 0
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be non-negative, got {self.max_model_len}")


def is_cpu_worker(desc: worker_pb2.WorkerDescription) -> bool:
    """Whether the worker computes on host CPUs (its torch device: "cpu")."""
    return desc.device.split(":")[0] == "cpu"


def max_model_len(flags: SchedulingFlags, worker_max_len: int) -> int:
    """The longest sequence served: --max-model-len, never past what the worker (or every worker) takes."""
    return min(flags.max_model_len or worker_max_len, worker_max_len)


def scheduler_for(flags: SchedulingFlags, desc: worker_pb2.WorkerDescription) -> Scheduler:
    """A scheduler for one worker: its cache as it described it, the policy as the flags set it."""
    max_len = max_model_len(flags, desc.max_model_len)
    # A CPU worker chunks prompts unless told otherwise. Without chunking, a step takes every waiting prompt that
    # fits max(max_model_len, 2048) tokens, and on a CPU such a step lasts seconds while every running stream waits
    # for it. The 64-request workload of `make bench` on 2 cores, one cluster per setting, three rounds: the same
    # throughput (206-217 output tok/s), inter-token p99 2150-2255 ms without chunking, 634-673 with a 512-token
    # budget, 350-384 with 256; the price is the last requests' first token (TTFT p99 11.0-11.9 -> 13.5-14.0 s), as
    # prompts share their steps with the decodes (docs/benchmarks-history.md, "Chunked prefill on a CPU worker").
    # vLLM's defaults elsewhere: without chunking a whole prompt must fit one step; with it, 512 tokens.
    cpu = is_cpu_worker(desc)
    chunked = cpu if flags.enable_chunked_prefill is None else flags.enable_chunked_prefill
    default_budget = (defaults.CPU_STEP_BUDGET if cpu else 512) if chunked else max(max_len, 2048)
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=flags.max_num_seqs, max_num_batched_tokens=flags.max_num_batched_tokens or default_budget,
            max_model_len=max_len, enable_chunked_prefill=chunked,
        ),
        CacheConfig(
            block_size=desc.block_size, num_gpu_blocks=desc.num_gpu_blocks, num_cpu_blocks=desc.num_cpu_blocks,
            enable_prefix_caching=flags.enable_prefix_caching, sliding_window=desc.sliding_window or None,
        ),
    )
