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

from llmserve.kernels import KernelBackend
from shared.sampling_params import SamplingParams
from worker_service.cache_engine import CacheEngine, CacheSizing, MemoryProfile
from worker_service.input_builder import build_inputs
from worker_service.model_loader import ModelShape
from worker_service.models import CausalLM
from worker_service.sequence_cache import CachedSequence

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

    Its inputs are built as a real step's (build_inputs), and like one it ends with the LM head on each
    sequence's last token. Returns the bytes of the temporary paged cache the pass wrote into.
    """
    seq_lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    blocks = [-(-n // block_size) for n in seq_lens]
    cache = CacheEngine(shape, CacheSizing(sum(blocks), 0), block_size, dtype, device, backend)
    seqs, first = [], 0
    for seq_id, (n, num_blocks) in enumerate(zip(seq_lens, blocks)):
        # Each sequence owns consecutive blocks.
        table = list(range(first, first + num_blocks))
        seqs.append(CachedSequence(seq_id, [0] * n, n, table, 0, SamplingParams(), num_new_tokens=n))
        first += num_blocks
    inputs = build_inputs(seqs, cache, device)
    with torch.inference_mode():
        hidden = model.forward(inputs.input_ids, inputs.positions, inputs.attn)
        model.compute_logits(hidden[inputs.sample_indices])
    return sum(c.numel() * c.element_size() for c in cache.key_caches + cache.value_caches)


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
