"""Scheduler and KV-cache configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from shared import defaults

# Largest block size the paged-attention kernels are expected to support.
_MAX_BLOCK_SIZE = 256


def _require_int(name: str, value: object, minimum: int = 1) -> None:
    # bool is an int subclass; True as a size is always a caller bug.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}.")


def _require_bool(name: str, value: object) -> None:
    # A truthy string such as "false" would silently switch a feature on.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}.")


@dataclass(kw_only=True)
class SchedulerConfig:
    """Limits on what one scheduling step may contain.

    max_num_seqs: most sequences running (holding KV blocks) at once.
    max_num_batched_tokens: most tokens computed in one step (prefill + decode). It may be smaller than
        max_model_len: with chunked prefill such long prompts are prefilled over several steps; without it they
        can never run and are ignored.
    max_model_len: longest sequence (prompt + output) the model accepts.
    enable_chunked_prefill: split prompts into chunks that share each step's token budget with the running
        decodes (decodes are scheduled first, so a long prompt never stalls them).
    """

    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = False

    def __post_init__(self) -> None:
        _require_int("max_num_seqs", self.max_num_seqs)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _require_int("max_model_len", self.max_model_len)
        _require_bool("enable_chunked_prefill", self.enable_chunked_prefill)


@dataclass(kw_only=True)
class CacheConfig:
    """Shape of the paged KV cache.

    block_size: tokens per KV block, a power of two in [1, 256].
    num_gpu_blocks: physical KV blocks available on the device.
    watermark: fraction of blocks kept free when admitting new prompts, so running sequences can keep decoding
        without immediate preemption.
    enable_prefix_caching: reuse the KV blocks of full, already computed blocks whose token prefix matches
        (content-addressed by a chained hash); unreferenced cached blocks stay resident until evicted (LRU).
    num_cpu_blocks: host (CPU) KV blocks for swap preemption; 0 disables swapping (a group that would be
        swapped out then fails instead).
    sliding_window: the model attends to this many most recent tokens in every layer (None: full attention).
        Blocks of older tokens are then reused (see BlockManager), unless prefix caching is on.
    """

    num_gpu_blocks: int
    block_size: int = defaults.BLOCK_SIZE
    watermark: float = 0.01
    enable_prefix_caching: bool = False
    num_cpu_blocks: int = 0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size)
        if self.block_size > _MAX_BLOCK_SIZE or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, {_MAX_BLOCK_SIZE}], got {self.block_size}.")
        _require_int("num_gpu_blocks", self.num_gpu_blocks)
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)):
            raise ValueError(f"watermark must be a number in [0, 1), got {self.watermark!r}.")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}.")
        _require_bool("enable_prefix_caching", self.enable_prefix_caching)
        _require_int("num_cpu_blocks", self.num_cpu_blocks, minimum=0)
        if self.sliding_window is not None:
            _require_int("sliding_window", self.sliding_window)

    @property
    def watermark_blocks(self) -> int:
        """Blocks that prompt admission must leave free."""
        return int(self.watermark * self.num_gpu_blocks)
