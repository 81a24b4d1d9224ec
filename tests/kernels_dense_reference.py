"""Vectorized float64 references for the paged kernels at serving shapes (thousands of tokens).

The references of tests/kernels_reference.py read one position and one head at a time in Python: right
by construction, but minutes per case at a 4096-token context. These compute the same definitions with
whole-tensor float64 operations (gather every position's key and value, then masked softmax), and
tests/unit/test_kernels_dense_reference.py checks them against the slow references on random small
cases, so a large-shape kernel test still rests on the layout definition.
"""

from __future__ import annotations

import torch


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``ref_reshape_and_cache`` for every token at once (negative slots skipped)."""
    x, block_size = key_cache.shape[4], key_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key, value = key[keep], value[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Two index tensors around slices: the indexed result is [tokens, kv_heads, head_size // x, x].
    key_cache[blocks, :, :, offsets, :] = key.reshape(len(slots), key.shape[1], -1, x).to(key_cache.dtype)
    value_cache[blocks, :, :, offsets] = value.to(value_cache.dtype)


def read_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
            length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions ``0 .. length-1`` of one block-table row: float64 ``[length, kv_heads, D]``."""
    block_size = key_cache.shape[3]
    positions = torch.arange(length)
    blocks, offsets = table.long()[positions // block_size], positions % block_size
    keys = key_cache[blocks, :, :, offsets, :].double()  # [length, kv_heads, D // x, x]
    values = value_cache[blocks, :, :, offsets].double()  # [length, kv_heads, D]
    return keys.reshape(length, keys.shape[1], -1), values


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor,
            scale: float, alibi_slopes: torch.Tensor | None, sliding_window: int | None) -> torch.Tensor:
    """Queries ``[Q, H, D]`` at ``query_positions`` over keys/values ``[L, KVH, D]``: causal, windowed, ALiBi."""
    num_heads, num_kv_heads = queries.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    k = keys.repeat_interleave(group, dim=1)  # [L, H, D]
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", queries.double(), k) * scale
    key_positions = torch.arange(keys.shape[0])
    distance = key_positions[None, :] - query_positions[:, None]  # [Q, L], <= 0 where visible
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.double()[:, None, None] * distance[None].double()
    visible = distance <= 0
    if sliding_window is not None:
        visible &= distance > -sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hql,lhd->qhd", weights, v)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    alibi_slopes: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """``ref_paged_attention``: float64 ``[num_seqs, num_heads, head_size]``, zeros for an empty context."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        keys, values = read_kv(key_cache, value_cache, block_tables[s], length)
        out[s] = _attend(query[s : s + 1], keys, values, torch.tensor([length - 1]), scale, alibi_slopes,
                         sliding_window)[0]
    return out


def context_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, alibi_slopes: torch.Tensor | None = None,
                      sliding_window: int | None = None) -> torch.Tensor:
    """``ref_context_attention``: float64 ``[num_tokens, num_heads, head_size]``; the queries are each
    sequence's newest positions."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        keys, values = read_kv(key_cache, value_cache, block_tables[b], seq_len)
        positions = torch.arange(seq_len - q_len, seq_len)
        out[starts[b] : starts[b + 1]] = _attend(query[starts[b] : starts[b + 1]], keys, values, positions, scale,
                                                 alibi_slopes, sliding_window)
    return out
