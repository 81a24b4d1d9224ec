"""Each row's top-k, nucleus (top-p) and min-p sets on the CPU, compiled, without sorting or a top-k over the row.

``logits_processing.top_k_top_p_cut`` decides most rows on their few hundred most likely tokens; with
torch it found those with a ``topk`` over the whole row and renormalised with an ``exp`` over it again,
after a tempered copy of the rows: 64 top-p rows of the default model's 49k vocabulary took 16-24 ms
a step on a 2-core Zen 5 (`sample()` in all), ~5 ms this way. Each row is read a few times, in
vector loops where it can be, at its temperature T:

1. its maximum ``m`` and ``e_i = exp((l_i - m) / T)`` with their sum ``z`` (the softmax's normaliser);
2. a histogram of the tokens by ``(m - l_i) / T`` in bins of 1/8 nat, with each bin's count and mass;
3. the first bins that hold the row's top-k (top_k tokens), or, without a top-k, a mass of top_p
   (a margin above it) give a threshold: the tokens above it are a prefix of the row in
   descending order, with every tie included, gathered and sorted (a few hundred tokens);
4. over that prefix, the nucleus exactly as ``_top_candidates`` decides it: the top-k renormalised
   over itself, the mass strictly before a token below top_p keeps it.

min-p (vLLM applies it after top-k / top-p) keeps the tokens at least min_p times as likely as the most
likely one, i.e. at most -log(min_p) nats below it: a prefix as well, so a row with min-p takes the
bins up to that distance when they come first, and the cut stops at the first token below the floor.

A row whose prefix would exceed the output's width (a wide nucleus; a top-k in a flat row, whose
bins each hold thousands of tokens), or whose threshold lies beyond the histogram, is left
undecided (``kept = -1``) for the torch path. Rounding differs from torch's (another exp, another
summation order), so a token whose preceding mass lies within ~1e-6 of top_p can fall on the other
side of the boundary: the same kind of near-tie that the race's noise already allows between a CPU
and a GPU worker.
"""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_decode import max_of
from llmserve.kernels.cpu._numba_exp import exp_f32
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

BINS_PER_NAT = 8
BINS = 64 * BINS_PER_NAT  # tokens more than 64 nats below the maximum: probability < 1e-27
# The histogram's mass is summed in another order than the exact pass: ask it for a little more.
_MASS_MARGIN = 1.0 + 1e-4

_SIGNATURE = numba.void(numba.float32[:, ::1], numba.int64[::1], numba.int64[::1], numba.float32[::1],
                        numba.float32[::1], numba.float32[::1], numba.float32[:, ::1], numba.int64[:, ::1],
                        numba.int64[::1])


@numba.njit(inline="always", cache=True)
def _bin(distance: np.float32) -> int:
    """The histogram bin of a token ``distance`` nats below the row's maximum (-inf and NaN: the last, never taken)."""
    if not distance < np.float32(BINS / BINS_PER_NAT):
        return BINS
    return int(distance * np.float32(BINS_PER_NAT))


# Its own function, so that its flags stay its own: reassociated, the sum runs in vector lanes (a float32 sum in
# order over 49k tokens was off by ~1e-5, enough to move a nucleus' boundary), in float64 it stays exact enough.
# The exponentials are taken apart, under the callers' flags: reassociation would undo exp_f32's range reduction.
# No 'nnan' / 'ninf': a NaN or an infinity among the values shows in the sum (_numba_log_normalizer's check).
@numba.njit(numba.float64(numba.float32[::1]), fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def sum_f64(values: np.ndarray) -> np.float64:
    total = np.float64(0.0)
    for i in range(values.shape[0]):
        total += np.float64(values[i])
    return total


@numba.njit(_SIGNATURE, parallel=True, fastmath={"contract"}, error_model="numpy", cache=True, nogil=True)
def nucleus_cut(logits: np.ndarray, rows: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                scale: np.ndarray, out_values: np.ndarray, out_ids: np.ndarray, kept: np.ndarray) -> None:
    """For each ``j``, row ``rows[j]`` of ``logits``, times ``scale[j]`` (the inverse temperature), cut to its top
    ``top_k[j]`` tokens (the vocabulary size for none), then to the nucleus of ``top_p[j]`` over those, then to
    the tokens at least ``min_p[j]`` times as likely as the most likely one (0: none): ``kept[j]`` tokens, most
    likely first, in ``out_values[j, :kept[j]]`` (their scaled logits) and ``out_ids[j, :kept[j]]``;
    ``kept[j] = -1`` when the row is not decided within ``out_values``' width."""
    vocab = logits.shape[1]
    width = out_values.shape[1]
    for j in numba.prange(rows.shape[0]):
        row = logits[rows[j]]
        k, p, floor, s = top_k[j], top_p[j], min_p[j], scale[j]
        kept[j] = -1
        # min-p keeps the tokens at most -log(min_p) nats below the most likely: a prefix too, within these bins
        # (a thousandth of a nat more, for the rounding of the exponentials it is decided on).
        floor_bin = _bin(np.float32(-np.log(floor) + 1e-3)) if floor > np.float32(0.0) else BINS
        largest = max_of(row, 0, vocab)
        weights = np.empty(vocab, dtype=np.float32)
        for i in range(vocab):
            weights[i] = exp_f32((row[i] - largest) * s)
        total = sum_f64(weights)
        counts = np.zeros(BINS + 1, dtype=np.int64)
        masses = np.zeros(BINS + 1, dtype=np.float64)
        for i in range(vocab):
            b = _bin((largest - row[i]) * s)
            counts[b] += 1
            masses[b] += weights[i]
        # The first bins that hold the top-k, or without one the nucleus' mass or min-p's tokens.
        target = np.float64(p) * total * _MASS_MARGIN
        last, count, mass = -1, 0, np.float64(0.0)
        for b in range(BINS):
            count += counts[b]
            mass += masses[b]
            if (k < vocab and count >= k) or (k >= vocab and (mass >= target or b >= floor_bin)):
                last = b
                break
        if last < 0 or count > width or count == 0:
            continue
        values = np.empty(count, dtype=np.float32)
        ids = np.empty(count, dtype=np.int64)
        n = 0
        for i in range(vocab):
            # The histogram's own bins (the same expression), so n stays below count; checked all the same.
            if _bin((largest - row[i]) * s) <= last and n < count:
                values[n] = row[i]
                ids[n] = i
                n += 1
        # Stable: equal logits stay in id order, the order torch's sort gives the row.
        order = np.argsort(-values, kind="mergesort")
        top = min(k, count)
        prefix = np.empty(top, dtype=np.float32)  # the top-k's weights, most likely first
        renormaliser = np.float64(0.0)
        for r in range(top):
            prefix[r] = exp_f32((values[order[r]] - largest) * s)
            renormaliser += prefix[r]
        if k >= vocab:
            renormaliser = total
        mass = np.float64(0.0)
        n = 0
        for r in range(top):
            if (p < np.float32(1.0) and mass >= p) or prefix[r] < floor:
                break
            mass += prefix[r] / renormaliser
            out_values[j, n] = values[order[r]] * s
            out_ids[j, n] = ids[order[r]]
            n += 1
        # Decided when the top-k lies among the prefix, the nucleus closed within it, or it holds min-p's tokens.
        if k <= count or mass >= p or last >= floor_bin:
            kept[j] = n
