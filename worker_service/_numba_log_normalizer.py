"""Each row's first maximum and log-normaliser (logsumexp) on the CPU, compiled: raw log-probabilities without a
log_softmax over the rows.

``sample()`` reports each sampled token's log-probability under the raw model distribution,
``l_c - logsumexp(l)``, and greedy rows take the row's first maximum. torch's ``log_softmax`` wrote a
[rows, vocab] tensor to read one element of each row, and its ``max`` read the rows once more: ~3 % of a
decode step (2.2 ms at 32 rows of the default model's 49k vocabulary, 4.7 ms at 64, on a 2-core Zen 4).
Here each row is read where it lies, a few times from L2 (its maximum, a finiteness check, its exponentials
into a per-thread scratch, their sum, the first index of the maximum), and nothing row-sized is written.

The exponentials are float32 (``exp_f32``, ~1 ulp) summed in float64 in vector lanes: the normaliser
differs from torch's float32 sum by ~1e-7. A row holding a NaN or an infinity is left to torch
(``first = -1``), which keeps torch's semantics for it (a NaN is the maximum).
"""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_decode import max_of
from llmserve.kernels.cpu._numba_exp import exp_f32
from llmserve.kernels.numba_cache import versioned_cache
from worker_service._numba_nucleus import sum_f64

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()


@numba.njit(numba.void(numba.float32[:, ::1], numba.int64[::1], numba.float32[::1], numba.int64), parallel=True,
            fastmath={"contract"}, cache=True, nogil=True)
def first_max_log_normalizer(logits: np.ndarray, first: np.ndarray, log_normalizer: np.ndarray, threads: int) -> None:
    """``first[r]``: the first index of row ``r``'s maximum; ``log_normalizer[r] = logsumexp(logits[r])``.

    ``first[r] = -1`` (and a NaN normaliser) for a row with a NaN or an infinity: the caller takes torch's
    path for it. Rows are split evenly between ``threads`` (a thread's scratch is one row of exponentials).
    """
    rows, vocab = logits.shape
    for t in numba.prange(threads):
        scratch = np.empty(vocab, dtype=np.float32)
        for r in range(rows * t // threads, rows * (t + 1) // threads):
            row = logits[r]
            if not np.isfinite(sum_f64(row)):
                first[r] = -1
                log_normalizer[r] = np.float32(np.nan)
                continue
            largest = max_of(row, 0, vocab)
            for i in range(vocab):
                scratch[i] = exp_f32(row[i] - largest)
            log_normalizer[r] = largest + np.float32(np.log(sum_f64(scratch)))
            i = 0
            while row[i] != largest:
                i += 1
            first[r] = i
