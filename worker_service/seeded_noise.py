"""Per-(seed, position) exponential noise for a whole batch in a few tensor ops.

A seeded sequence's random draw at output position i must depend on
(seed, i) alone: then its token is the same whatever shares the batch, and
again when the sequence is recomputed after a preemption or a restart. A
torch.Generator per row gives that but costs a Python loop (and a host
generator) per seeded row; a counter-based hash gives it for all rows at
once, on any device, bit for bit the same everywhere.

The hash works on 32-bit words held in int64 tensors. Multiplications are
split in 16-bit halves so that no intermediate leaves int64's range: integer
overflow is never relied on.

    x * c mod 2^32  =  ((x_hi * c) mod 2^16) * 2^16  +  x_lo * c   (mod 2^32)
    where x = x_hi * 2^16 + x_lo; each product < 2^48
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
# Odd constants of Chris Wellons' "lowbias32" integer hash (a bijection on 32-bit words).
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
# Distinct odd constants separate the streams derived from one key.
_GOLDEN = 0x9E3779B9
_STREAM_B = 0x85EBCA6B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    low = (x & _MASK16) * c
    high = ((x >> 16) * c) & _MASK16
    return (low + (high << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def row_keys(seeds: list[int], positions: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit words per row, each mixing all 96 bits of (64-bit seed, 32-bit position)."""
    lo = torch.tensor([s & _MASK32 for s in seeds], dtype=torch.int64, device=device)
    hi = torch.tensor([(s >> 32) & _MASK32 for s in seeds], dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device) & _MASK32
    a = _hash32(_hash32(_hash32(pos ^ _GOLDEN) ^ lo) ^ hi)
    b = _hash32(_hash32(_hash32(((pos + _STREAM_B) & _MASK32) ^ hi) ^ lo) ^ a)
    return a, b


def seeded_exponentials(seeds: list[int], positions: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) noise; row i is a function of (seeds[i], positions[i]) only.

    Seeds are any non-negative integers below 2**64. Each entry hashes (row key, token id) to a
    32-bit word x and returns -log(u) for u = (2 (x >> 9) + 1) / 2^24: exact in float32, never 0 or 1,
    and the same u as the CPU sampler's compiled race (_numba_race.py) draws.
    """
    a, b = row_keys(seeds, positions, device)
    tokens = torch.arange(vocab, dtype=torch.int64, device=device)
    x = _hash32(_hash32(tokens.unsqueeze(0) ^ a.unsqueeze(1)) ^ b.unsqueeze(1))
    uniform = (2 * (x >> 9) + 1).double() / float(1 << 24)
    return (-uniform.log()).float()
