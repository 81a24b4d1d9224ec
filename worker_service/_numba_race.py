"""The exponential race over a batch of logits rows on the CPU, in one compiled pass per row.

``sampler.py`` draws a random row's token as ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)``.
Written as tensor ops on a CPU that pass took most of a sampled step: torch's
``exponential_()`` alone spent 103 ms on 64 rows of a 49k vocabulary on a 2-core Zen 1
(``uniform_().log_()`` 23 ms; the counter-based hash of seeded rows, over int64 tensors, 185 ms).
Here each row is read once: its maximum, then per token the unnormalised probability
``exp((l_i - max) / T)`` (the row's normaliser does not move the argmax), the token's noise
``E_i = -log(u_i)``, and the best ratio, all in eight-lane vector code.

Every row's noise comes from the counter-based hash of ``seeded_noise.py``: ``u_i`` is
``(2k + 1) / 2^24`` for the top 23 bits ``k`` of ``hash(hash(i ^ a) ^ b)``, exact in float32 and
never 0 or 1, so ``E_i`` is finite and positive. A seeded row's keys ``(a, b)`` come from its seed and output
position, so its token depends on them and the logits alone; an unseeded row's keys are drawn
from torch's generator.
"""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_decode import max_of
from llmserve.kernels.cpu._numba_exp import exp_f32, log_f32
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

_U32 = np.uint32
# Chris Wellons' "lowbias32", as seeded_noise.py computes it over int64 tensors (same words out).
_MUL1 = np.uint32(0x7FEB352D)
_MUL2 = np.uint32(0x846CA68B)
_INV_2_24 = np.float32(1.0 / (1 << 24))

_SIGNATURE = numba.void(numba.float32[:, ::1], numba.float32[::1], numba.uint32[::1], numba.uint32[::1],
                        numba.int64[::1])


@numba.njit(inline="always", cache=True)
def _hash32(x: np.uint32) -> np.uint32:
    # Each product cast back to 32 bits (Numba widens uint32 products): the multiply is then a 32-bit lane op.
    x = x ^ (x >> _U32(16))
    x = _U32(x * _MUL1)
    x = x ^ (x >> _U32(15))
    x = _U32(x * _MUL2)
    return x ^ (x >> _U32(16))


@numba.njit(inline="always", cache=True)
def _noise(token: int, a: np.uint32, b: np.uint32) -> np.float32:
    """Token ``token``'s E = -log(u) of a row keyed (a, b): u = (2k + 1) / 2^24 for the hash's top 23 bits k,
    exact in float32, never 0 or 1."""
    k = np.int32(_hash32(_hash32(_U32(token) ^ a) ^ b) >> _U32(9))
    return -log_f32(np.float32(k * np.int32(2) + np.int32(1)) * _INV_2_24)


# error_model="numpy": a float division is IEEE's, not Python's (whose zero check kept the loop scalar).
@numba.njit(_SIGNATURE, parallel=True, fastmath={"contract"}, error_model="numpy", cache=True, nogil=True)
def race_tokens(logits: np.ndarray, inverse_temperature: np.ndarray, key_a: np.ndarray, key_b: np.ndarray,
                out: np.ndarray) -> None:
    """``out[r] = argmax_i exp((logits[r, i] - max) * inverse_temperature[r]) / E_i`` (the first on a tie).

    ``logits`` may hold -inf (masked tokens: probability 0, never chosen while one token is finite);
    ``key_a`` / ``key_b`` are a row's two 32-bit keys (``seeded_noise.row_keys``).
    """
    rows, vocab = logits.shape
    for r in numba.prange(rows):
        row = logits[r]
        largest = max_of(row, 0, vocab)
        scale = inverse_temperature[r]
        a, b = key_a[r], key_b[r]
        ratios = np.empty(vocab, dtype=np.float32)
        for i in range(vocab):
            ratios[i] = exp_f32((row[i] - largest) * scale) / _noise(i, a, b)
        best = max_of(ratios, 0, vocab)
        chosen = 0
        for i in range(vocab):
            if ratios[i] == best:
                chosen = i
                break
        out[r] = chosen


_CANDIDATES_SIGNATURE = numba.void(numba.float32[:, ::1], numba.int64[:, ::1], numba.uint32[::1], numba.uint32[::1],
                                   numba.int64[::1])


@numba.njit(_CANDIDATES_SIGNATURE, parallel=True, fastmath={"contract"}, error_model="numpy", cache=True, nogil=True)
def race_candidates(values: np.ndarray, token_ids: np.ndarray, key_a: np.ndarray, key_b: np.ndarray,
                    out: np.ndarray) -> None:
    """race_tokens over each row's candidates only (``values[r, j]`` is token ``token_ids[r, j]``'s logit, -inf
    outside the row's top-k / nucleus), at temperature 1: the same token as race_tokens over the whole row
    masked to those sets, since every token outside them has probability 0 and each token's noise is keyed
    by its id. A top-p row's nucleus is a few hundred tokens, not the whole vocabulary."""
    rows, count = values.shape
    scale = np.float32(1.0)
    for r in numba.prange(rows):
        largest = max_of(values[r], 0, count)
        a, b = key_a[r], key_b[r]
        best = np.float32(-1.0)
        chosen = np.int64(-1)
        for j in range(count):
            i = token_ids[r, j]
            ratio = exp_f32((values[r, j] - largest) * scale) / _noise(i, a, b)
            # race_tokens takes the first token of the row on a tie: the smallest id.
            if ratio > best or (ratio == best and i < chosen):
                best, chosen = ratio, i
        out[r] = chosen
