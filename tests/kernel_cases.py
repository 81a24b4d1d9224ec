"""Random inputs for the paged KV-cache kernel tests, shared by every backend's tests.

Every case builds its own inputs (seeded per case, so a failure reproduces): a
cache whose unwritten slots are NaN (so reading padding or a stale block shows
up), block tables that are a random permutation of the physical blocks (never
contiguous by accident), and an output poisoned with NaN (so a row the kernel
forgets to write fails). :func:`run_paged` and :func:`run_context` run one
backend's kernel on such a case and return its error against the float64
references of :mod:`tests.kernels_reference`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from llmserve import kernels
from llmserve.kernels.backend import ContextAttentionFn, PagedAttentionFn
from tests import kernels_dense_reference as dense_ref
from tests.kernels_reference import ref_context_attention, ref_paged_attention, ref_reshape_and_cache

# Max-abs error relative to the reference's max-abs value. fp32 computes in fp32;
# half types also compute in fp32, so their error is mostly the final rounding
# of the output (2^-9 for bf16, 2^-11 for fp16) plus a margin.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-3, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert not torch.isnan(actual).any(), "output has NaN (unwritten row or NaN leaked from the cache)"
    return float((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


class PagedCache:
    """A NaN-poisoned paged cache holding given sequences at randomly permuted blocks.

    ``stale``: the slots no sequence wrote hold large finite values instead, as a block reused from a
    finished sequence does; a kernel that lets one of them into its softmax gets a wrong, finite result
    (a NaN there can vanish: an exp that maps NaN to 0 hides an unmasked slot).
    """

    def __init__(
        self,
        seq_lens: list[int],
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        dtype: torch.dtype,
        gen: torch.Generator,
        spare_blocks: int = 3,
        unused_table_entry: int | None = None,
        dense: bool = False,
        stale: bool = False,
    ) -> None:
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        self.block_size = block_size
        sizes = (num_blocks, num_kv_heads, head_size, block_size, dtype)
        if stale:
            self.key_cache = (torch.randn(kernels.key_cache_shape(*sizes), generator=gen) * 8).to(dtype)
            self.value_cache = (torch.randn(kernels.value_cache_shape(*sizes), generator=gen) * 100).to(dtype)
        else:
            self.key_cache = torch.full(kernels.key_cache_shape(*sizes), float("nan"), dtype=dtype)
            self.value_cache = torch.full(kernels.value_cache_shape(*sizes), float("nan"), dtype=dtype)
        physical = torch.randperm(num_blocks, generator=gen).tolist()
        max_blocks = max(blocks_per_seq + [1]) + 2  # extra columns past every sequence's last block
        # Entries past the used blocks are garbage: random ids, or a fixed value when asked.
        table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
        if unused_table_entry is not None:
            table.fill_(unused_table_entry)
        for s, n in enumerate(blocks_per_seq):
            table[s, :n] = torch.tensor(physical[:n], dtype=torch.long)
            physical = physical[n:]
        self.block_tables = table.to(torch.int32)

        # Write every position's key/value with the reference writer.
        slots = []
        for s, n in enumerate(seq_lens):
            for p in range(n):
                slots.append(int(table[s, p // block_size]) * block_size + p % block_size)
        total = len(slots)
        self.keys = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
        self.values = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        write = dense_ref.write_kv if dense else ref_reshape_and_cache
        write(self.keys, self.values, self.key_cache, self.value_cache, self.slot_mapping)


def alibi_slopes_for(num_heads: int) -> torch.Tensor:
    # The standard ALiBi geometric slopes (2^(-8/n), 2^(-16/n), ...).
    return torch.tensor([2 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float32)


def stable_seed(*parts: str) -> int:
    # Python's str hash is salted per process; crc32 keeps failures reproducible.
    return zlib.crc32("/".join(parts).encode())


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def config_id(cfg: tuple) -> str:
    """Test id of a (dtype, num_heads, num_kv_heads, head_size, block_size) config."""
    dtype, h, kvh, d, bs = cfg
    return f"{str(dtype).removeprefix('torch.')}-h{h}kv{kvh}-d{d}-bs{bs}"


def feature_id(feature: tuple) -> str:
    """Test id of a (use_alibi, sliding_window) pair."""
    alibi, window = feature
    return ("alibi" if alibi else "noalibi") + (f"-win{window}" if window else "")


def run_paged(
    kernel: PagedAttentionFn,
    cfg: tuple,
    context_lens: list[int],
    use_alibi: bool,
    sliding_window: int | None,
    seed: int,
    unused_table_entry: int | None = None,
    dense: bool = False,
    stale: bool = False,
) -> float:
    """Decode attention of ``kernel`` on a fresh case; returns the relative error. ``dense``: build the case and
    the expected output with tests/kernels_dense_reference.py (serving shapes); ``stale``: see PagedCache."""
    dtype, num_heads, num_kv_heads, head_size, block_size = cfg
    gen = torch.Generator().manual_seed(seed)
    cache = PagedCache(
        context_lens, num_kv_heads, head_size, block_size, dtype, gen, unused_table_entry=unused_table_entry,
        dense=dense, stale=stale,
    )
    query = torch.randn(len(context_lens), num_heads, head_size, generator=gen).to(dtype)
    slopes = alibi_slopes_for(num_heads) if use_alibi else None
    scale = head_size**-0.5
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = nan_like(query)
    kernel(
        out, query, cache.key_cache, cache.value_cache, num_kv_heads, scale, cache.block_tables, lens,
        block_size, max(context_lens), alibi_slopes=slopes, sliding_window=sliding_window,
    )  # fmt: skip
    expected = (dense_ref.paged_attention if dense else ref_paged_attention)(
        query, cache.key_cache, cache.value_cache, cache.block_tables, lens, scale, slopes, sliding_window
    )
    assert out.dtype == dtype
    return rel_error(out, expected)


def run_context(
    kernel: ContextAttentionFn,
    cfg: tuple,
    seqs: list[tuple[int, int]],
    use_alibi: bool,
    sliding_window: int | None,
    seed: int,
    dense: bool = False,
    stale: bool = False,
) -> float:
    """Prefill attention of ``kernel`` on a fresh case; ``seqs``: (seq_len, q_len) per sequence, the
    q_len newest positions being the queries. Returns the relative error. ``dense`` and ``stale`` as for
    run_paged."""
    dtype, num_heads, num_kv_heads, head_size, block_size = cfg
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [n for n, _ in seqs]
    cache = PagedCache(seq_lens, num_kv_heads, head_size, block_size, dtype, gen, dense=dense, stale=stale)
    starts = [0]
    for _, q_len in seqs:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], num_heads, head_size, generator=gen).to(dtype)
    slopes = alibi_slopes_for(num_heads) if use_alibi else None
    scale = head_size**-0.5
    qsl = torch.tensor(starts, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = nan_like(query)
    kernel(
        out, query, cache.key_cache, cache.value_cache, num_kv_heads, scale, cache.block_tables, qsl, lens,
        block_size, alibi_slopes=slopes, sliding_window=sliding_window,
    )  # fmt: skip
    expected = (dense_ref.context_attention if dense else ref_context_attention)(
        query, cache.key_cache, cache.value_cache, cache.block_tables, qsl, lens, scale, slopes, sliding_window
    )
    assert out.dtype == dtype
    return rel_error(out, expected)


@dataclass
class CacheWriteCase:
    """Tokens to write into random caches, and the caches as the reference writer leaves them."""

    kv: torch.Tensor  # [tokens, 2, kv_heads, head_size]: key and value are strided views, as from a fused qkv
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor  # padding tokens have slot -1
    expected_key_cache: torch.Tensor
    expected_value_cache: torch.Tensor

    @property
    def key(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def value(self) -> torch.Tensor:
        return self.kv[:, 1]


def cache_write_case(dtype: torch.dtype, num_blocks: int, num_kv_heads: int, head_size: int, block_size: int,
                     num_tokens: int, padding: list[int], seed: int, dense: bool = False) -> CacheWriteCase:
    """A reshape_and_cache case on the CPU: distinct random slots, the tokens at ``padding`` marked -1."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (num_blocks, num_kv_heads, head_size, block_size, dtype)
    key_cache = torch.randn(kernels.key_cache_shape(*sizes), generator=gen).to(dtype)
    value_cache = torch.randn(kernels.value_cache_shape(*sizes), generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[padding] = -1
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_size, generator=gen).to(dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    (dense_ref.write_kv if dense else ref_reshape_and_cache)(kv[:, 0], kv[:, 1], expected_k, expected_v, slots)
    return CacheWriteCase(kv, key_cache, value_cache, slots, expected_k, expected_v)
