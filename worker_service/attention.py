"""Attention over the paged KV cache for one step, for the worker's own models and transformers' modules.

`attend` writes the step's new keys/values into the paged cache and attends over
it with the `kernels` backend; the fused models (worker_service/models) call it
directly. For models that run transformers' modules, the same function is
registered as a transformers attention implementation: per-step metadata then
reaches it through the model's forward kwargs (transformers passes unknown
kwargs down to the attention interface).

The flattened batch is ordered prefills first, then decodes:

    tokens:  [ p0 p0 p0 | p1 p1 | d0 | d1 | d2 ]
              prefill tokens     decode tokens (one query each)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from llmserve.kernels import KernelBackend

ATTN_IMPLEMENTATION = "llmserve_paged"
METADATA_KWARG = "llmserve_attn_metadata"


@dataclass
class AttentionMetadata:
    """Where each token of the flattened batch goes and what it attends to."""

    backend: KernelBackend
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    block_size: int
    # [num_tokens] cache slot of every token (block_id * block_size + offset).
    slot_mapping: torch.Tensor
    # Prefill part: sequences with more than one query token.
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context incl. new tokens
    # Decode part: one query token per sequence.
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    decode_max_context_len: int
    # Called with a layer's index before it touches its cache: blocks swapped in this step on a GPU
    # side stream must have landed (CacheEngine.wait_for_layer); a no-op on a CPU.
    wait_for_layer: Callable[[int], None]
    # Entered around the cache write and the attention kernels: on a CPU it gives them every thread
    # while the ops between run on one (MatmulThreads.full); nothing elsewhere.
    kernel_threads: Callable[[], AbstractContextManager[object]] = nullcontext

    @property
    def num_decodes(self) -> int:
        return int(self.decode_context_lens.shape[0])


def attend(
    meta: AttentionMetadata,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Writes the step's keys/values of ``layer`` into the paged cache and attends over it.

    q: ``[T, num_heads, D]``; k/v: ``[T, num_kv_heads, D]`` (rotary applied; views are fine).
    Returns ``[T, num_heads, D]``: prefill rows first, then one row per decode, as the batch is ordered.
    """
    num_kv_heads = k.shape[1]
    meta.wait_for_layer(layer)
    key_cache = meta.key_caches[layer]
    value_cache = meta.value_caches[layer]
    backend = meta.backend
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_prefill = meta.num_prefill_tokens
    with meta.kernel_threads():
        backend.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        if num_prefill:
            backend.context_attention(
                out[:num_prefill], q[:num_prefill], key_cache, value_cache, num_kv_heads, scaling,
                meta.prefill_block_tables, meta.prefill_query_start_loc, meta.prefill_seq_lens,
                meta.block_size, sliding_window=sliding_window,
            )
        if meta.num_decodes:
            backend.paged_attention(
                out[num_prefill:], q[num_prefill:], key_cache, value_cache, num_kv_heads, scaling,
                meta.decode_block_tables, meta.decode_context_lens, meta.block_size,
                meta.decode_max_context_len, sliding_window=sliding_window,
            )
    return out


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface over the paged KV cache (the transformers-modules path).

    query: [1, num_heads, T, D]; key/value: [1, num_kv_heads, T, D] (rotary applied).
    Returns [1, T, num_heads, D] as transformers' own attention functions do.
    """
    meta = kwargs.get(METADATA_KWARG)
    if not isinstance(meta, AttentionMetadata):
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs {METADATA_KWARG} in the forward kwargs")
    q = query[0].transpose(0, 1)  # [T, H, D]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    # Models with sliding-window layers (Mistral) pass the window per call.
    sliding_window = kwargs.get("sliding_window")
    out = attend(meta, module.layer_idx, q, key[0].transpose(0, 1), value[0].transpose(0, 1), scaling,
                 sliding_window)  # type: ignore[arg-type]
    return out.unsqueeze(0), None


def register() -> str:
    """Registers the paged attention function with transformers; returns its name."""
    # Imported here: transformers' model code (modeling_utils) costs a worker ~1.5 s of start-up, and only the
    # transformers-module models need it (the fused ones build their layers from the checkpoint's tensors).
    from transformers import AttentionInterface  # noqa: PLC0415

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
