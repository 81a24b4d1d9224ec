"""A profiling forward pass that measures a GPU's peak memory, to size the KV cache (vLLM's rule).

At start-up, before the cache exists, the worker runs one step of dummy
prefills as large as a step can get and reads the peak memory from torch's
allocator; :func:`worker_service.cache_engine.gpu_cache_bytes` turns that into
the cache's budget. The pass needs a paged cache for its own tokens (the model
attends through it); that small cache is allocated for the pass, and its bytes
are not counted in the peak, since the real cache takes its place.
"""

from __future__ import annotations

import torch
from kernels import KernelBackend, allocate_kv_cache
from worker_service.attention import AttentionMetadata
from worker_service.cache_engine import MemoryProfile
from worker_service.model_loader import ModelShape
from worker_service.models import CausalLM

# The scheduler's default step budget is max(max_model_len, 2048) tokens (vLLM's); the
# worker does not know the scheduler's flags, so it profiles that default.
_MIN_PROFILE_TOKENS = 2048


def profile_num_tokens(max_model_len: int) -> int:
    """Tokens of the profiling step: the scheduler's default largest step."""
    return max(max_model_len, _MIN_PROFILE_TOKENS)


def profile_step(
    model: CausalLM,
    backend: KernelBackend,
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    num_tokens: int,
    max_model_len: int,
) -> int:
    """Run one forward pass of dummy prefills over ``num_tokens`` tokens, none longer than ``max_model_len``.

    Like a real step it ends with the LM head on each sequence's last token.
    Returns the bytes of the temporary paged cache the pass wrote into.
    """
    seq_lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    blocks = [-(-n // block_size) for n in seq_lens]
    # Each sequence owns consecutive blocks, so its slots are consecutive from its first block's.
    first_block = [sum(blocks[:b]) for b in range(len(blocks))]
    key_caches, value_caches = allocate_kv_cache(
        shape.num_layers, sum(blocks), shape.num_kv_heads, shape.head_size, block_size, dtype, device
    )
    cache_bytes = sum(c.numel() * c.element_size() for c in key_caches + value_caches)
    width = max(blocks)
    tables = [[first + min(i, n - 1) for i in range(width)] for first, n in zip(first_block, blocks)]
    slots = [first * block_size + p for first, n in zip(first_block, seq_lens) for p in range(n)]
    starts = [sum(seq_lens[:b]) for b in range(len(seq_lens) + 1)]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        backend=backend,
        key_caches=key_caches,
        value_caches=value_caches,
        block_size=block_size,
        slot_mapping=tensor(slots, torch.int64),
        num_prefill_tokens=num_tokens,
        prefill_block_tables=tensor(tables, torch.int32),
        prefill_query_start_loc=tensor(starts, torch.int32),
        prefill_seq_lens=tensor(seq_lens, torch.int32),
        decode_block_tables=torch.zeros(0, width, dtype=torch.int32, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
        decode_max_context_len=0,
    )
    positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
    with torch.inference_mode():
        hidden = model.forward(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, meta)
        last_rows = tensor(starts[1:], torch.int64) - 1
        model.compute_logits(hidden[last_rows])
    return cache_bytes


def profile_gpu_memory(
    model: CausalLM,
    backend: KernelBackend,
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    max_model_len: int,
) -> MemoryProfile:
    """Peak memory on ``device`` (a CUDA device) during the largest step, with the model already loaded.

    Peak = memory in use before the pass (weights, CUDA context, other processes)
    + the most torch reserved beyond that during the pass, less the pass's own cache.
    """
    num_tokens = profile_num_tokens(max_model_len)
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    free_before, total = torch.cuda.mem_get_info(device)
    reserved_before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache_bytes = profile_step(model, backend, shape, dtype, device, block_size, num_tokens, max_model_len)
    torch.cuda.synchronize(device)
    pass_bytes = torch.cuda.max_memory_reserved(device) - reserved_before - cache_bytes
    # Hand the pass's memory back: the real cache is allocated next, from the same pool.
    torch.cuda.empty_cache()
    return MemoryProfile(total_bytes=total, peak_bytes=(total - free_before) + max(pass_bytes, 0), num_tokens=num_tokens)
