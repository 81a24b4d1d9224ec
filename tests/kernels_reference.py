"""Slow, obviously-correct float64 references for the paged KV-cache kernels.

Written from the layout definition alone (see kernels/layout.py), with no code
shared with the implementations: every cache element is addressed as

    key   (position p, kv head h, dim d) = key_cache[table[p // bs], h, d // x, p % bs, d % x]
    value (position p, kv head h, dim d) = value_cache[table[p // bs], h, d, p % bs]

and attention is computed per sequence, per head, per position in float64.
"""

from __future__ import annotations

import math

import torch


def _key_at(key_cache: torch.Tensor, block: int, kv_head: int, offset: int) -> torch.Tensor:
    x = key_cache.shape[4]
    head_size = key_cache.shape[2] * x
    d = torch.arange(head_size)
    return key_cache[block, kv_head, d // x, offset, d % x].double()


def _value_at(value_cache: torch.Tensor, block: int, kv_head: int, offset: int) -> torch.Tensor:
    return value_cache[block, kv_head, :, offset].double()


def _read_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: list[int],
    kv_head: int,
    positions: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[len(positions), head_size]`` (float64) of one kv head, read one position at a time."""
    block_size = key_cache.shape[3]
    keys, values = [], []
    for p in positions:
        block, offset = table[p // block_size], p % block_size
        keys.append(_key_at(key_cache, block, kv_head, offset))
        values.append(_value_at(value_cache, block, kv_head, offset))
    head_size = value_cache.shape[2]
    if not positions:
        empty = torch.zeros(0, head_size, dtype=torch.float64)
        return empty, empty
    return torch.stack(keys), torch.stack(values)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, biases: list[float]
) -> torch.Tensor:
    """softmax(scale * q.k_i + bias_i) weighted sum of v_i, in float64 with max subtraction."""
    scores = [scale * float(torch.dot(q, keys[i])) + biases[i] for i in range(keys.shape[0])]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    result = torch.zeros(values.shape[1], dtype=torch.float64)
    for w, v in zip(weights, values):
        result += (w / total) * v
    return result


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t`` into slot ``slot_mapping[t]`` (skipping negative slots), one token at a time."""
    block_size = key_cache.shape[3]
    x = key_cache.shape[4]
    head_size = key.shape[2]
    d = torch.arange(head_size)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = slot // block_size, slot % block_size
        for h in range(key.shape[1]):
            key_cache[block, h, d // x, offset, d % x] = key[t, h]
            value_cache[block, h, d, offset] = value[t, h]


def ref_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention, float64 ``[num_seqs, num_heads, head_size]``; an empty context gives zeros."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64)
    for s in range(num_seqs):
        context_len = int(context_lens[s])
        table = block_tables[s].tolist()
        last = context_len - 1
        positions = [i for i in range(context_len) if sliding_window is None or i > last - sliding_window]
        if not positions:
            continue
        for h in range(num_heads):
            keys, values = _read_kv(key_cache, value_cache, table, h // group, positions)
            slope = 0.0 if alibi_slopes is None else float(alibi_slopes[h])
            biases = [slope * (i - last) for i in positions]
            out[s, h] = _attend(query[s, h].double(), keys, values, scale, biases)
    return out


def ref_context_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal prefill attention, float64 ``[num_tokens, num_heads, head_size]``."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        table = block_tables[b].tolist()
        q_len = starts[b + 1] - starts[b]
        # Read every position of the sequence once per kv head, then slice per query.
        kv = [_read_kv(key_cache, value_cache, table, g, list(range(seq_len))) for g in range(num_kv_heads)]
        for i in range(q_len):
            p = seq_len - q_len + i
            positions = [j for j in range(p + 1) if sliding_window is None or j > p - sliding_window]
            for h in range(num_heads):
                keys, values = kv[h // group]
                slope = 0.0 if alibi_slopes is None else float(alibi_slopes[h])
                biases = [slope * (j - p) for j in positions]
                out[starts[b] + i, h] = _attend(
                    query[starts[b] + i, h].double(), keys[positions], values[positions], scale, biases
                )
    return out
