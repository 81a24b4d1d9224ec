"""A float32 projection ``x @ W^T (+ b)`` over weights laid out in column panels, as Numba register tiles.

The weight ``[N, K]`` is stored once, at load, as panels of ``PANEL`` (48) output columns, each
``[K, 48]`` contiguous (a last panel of 16 or 32 columns where N is not a multiple of 48). Each thread
owns a contiguous run of panels and takes them front to back; one done with its own helps the others
from the back of theirs (``_next_panel``). For each panel a thread walks the rows of ``x`` in tiles of 8
(then 4, then 3, 2 or 1) and keeps ``rows x 3`` vectors of 16 sums in registers (``gemm_tile_from``), each
step one broadcast element of ``x`` against the panel's three vectors at that ``k``; the sums start from the
bias (or zero) in registers, so ``out`` is only written. A panel (110 KiB at K = 576) is read from
memory once and then from L2 for every tile of rows after the first.

Every output element is one chain of multiply-adds in order of ``k``, started from the bias (or
zero): the same chain whichever tile computes its row, however many rows the call has and however
many threads run it. A sequence's projections therefore do not depend on what it is batched
with, which oneDNN's kernels (blocked along ``k`` by row count) do not promise.

Why it exists: on a 2-core AMD EPYC Zen 4 (AVX-512, one 512-bit FMA a cycle), the default model's
projections of one step, every layer's weights read from memory (docs/benchmarks-history.md), took
86-90 ms at 64 rows against oneDNN's packed 90-94 ms, 25-27 against 32 ms at 16 rows and 676-704
against 747-769 ms at 512 (a prefill), with no row padding (oneDNN's primitives need row buckets,
models/linear.py). A tile of 8 x 3 vectors is 24 accumulators of the 32 registers AVX-512 has; on
AVX2's 16 it would spill, so models/linear.py takes this path only on AVX-512 CPUs. Starting the sums in
registers instead of filling ``out`` with the bias first and loading it back took 9-10 % more off (one layer's
four projections hot, 64 / 512 / 2048 rows: 189 / 202 / 200 -> 209 / 223 / 221 GFLOP/s on the Zen 4 above).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from llmserve.kernels.cpu._numba_llvm import fetch_add, gemm_tile_from
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

PANEL = 48  # output columns per panel: three vectors of 16 float32
LANES = 16


def panel_widths(out_features: int) -> bool:
    """Whether a weight of ``out_features`` rows can be laid out in panels (whole 16-column vectors)."""
    return out_features > 0 and out_features % LANES == 0


def pack_panels(weight: torch.Tensor, into: np.ndarray | None = None) -> np.ndarray:
    """``weight [N, K]`` (float32, CPU) as the flat panel layout ``panel_matmul`` reads (a copy), written into
    ``into`` (``N * K`` float32) when given: a row of a stack over the layers (models/compiled_decode.py)."""
    n, k = weight.shape
    if not panel_widths(n):
        raise ValueError(f"panel layout needs a multiple of {LANES} output features, got {n}")
    if into is not None and (into.shape != (n * k,) or into.dtype != np.float32):
        raise ValueError(f"panels of a [{n}, {k}] weight need {n * k} float32, got {into.shape} {into.dtype}")
    full = n // PANEL
    head = full * PANEL
    flat = torch.empty(n * k, dtype=torch.float32) if into is None else torch.from_numpy(into)
    # Panel p holds columns p*48 .. p*48+47 as [K, 48]: row k is weight[p*48:(p+1)*48, k]. One copy,
    # by torch's threads: at load, 0.05 s for the default model's LM head against 0.07 in numpy.
    flat[:head * k].view(full, k, PANEL).copy_(weight[:head].reshape(full, PANEL, k).transpose(1, 2))
    flat[head * k:].view(k, n - head).copy_(weight[head:].T)  # the narrower last panel, [K, N - head]
    return flat.numpy()


@numba.njit(inline="always")
def _tiles(of: np.ndarray, out_at: int, n: int, start: np.ndarray, start_at: int, xf: np.ndarray, k: int, rows: int,
           wf: np.ndarray, at: int, vectors: int) -> None:
    """out[:, col:col + 16 * vectors] = start + x @ panel for every row: tiles of 8 rows, then 4, then 3, 2 or 1."""
    width = vectors * LANES
    r = 0
    while r + 8 <= rows:
        gemm_tile_from(of, out_at + r * n, n, start, start_at, xf, r * k, k, 1, 1, wf, at, width, k, 8, vectors, 16)
        r += 8
    if r + 4 <= rows:
        gemm_tile_from(of, out_at + r * n, n, start, start_at, xf, r * k, k, 1, 1, wf, at, width, k, 4, vectors, 16)
        r += 4
    # At most three rows left: one more pass over the panel (each pass reads it from L1/L2 again).
    if r + 3 == rows:
        gemm_tile_from(of, out_at + r * n, n, start, start_at, xf, r * k, k, 1, 1, wf, at, width, k, 3, vectors, 16)
    elif r + 2 == rows:
        gemm_tile_from(of, out_at + r * n, n, start, start_at, xf, r * k, k, 1, 1, wf, at, width, k, 2, vectors, 16)
    elif r < rows:
        gemm_tile_from(of, out_at + r * n, n, start, start_at, xf, r * k, k, 1, 1, wf, at, width, k, 1, vectors, 16)


@numba.njit(inline="always")
def _strip(of: np.ndarray, out_at: int, n: int, start: np.ndarray, start_at: int, xf: np.ndarray, k: int, rows: int,
           wf: np.ndarray, at: int, width: int) -> None:
    """One panel's columns (``width`` 48, 32 or 16): the tile's vector count must be a compile-time literal."""
    if width == 48:
        _tiles(of, out_at, n, start, start_at, xf, k, rows, wf, at, 3)
    elif width == 32:
        _tiles(of, out_at, n, start, start_at, xf, k, rows, wf, at, 2)
    else:
        _tiles(of, out_at, n, start, start_at, xf, k, rows, wf, at, 1)


# A segment's three counters, a cache line apart: panels taken, taken from its front, taken from its back.
_TAKEN, _FRONT, _BACK, _SEGMENT_STRIDE = 0, 8, 16, 24


@numba.njit(inline="always")
def _next_panel(counters: np.ndarray, segment: int, lo: int, size: int, owner: bool) -> int:
    """The next panel of the segment ``lo .. lo + size - 1`` for its owner (from the front) or a helper (from the
    back), -1 once every panel is taken. The taken count admits at most ``size`` takes, so the front's and the
    back's never meet and together reach every panel."""
    at = segment * _SEGMENT_STRIDE
    if fetch_add(counters[at + _TAKEN:]) >= size:
        return -1
    if owner:
        return lo + fetch_add(counters[at + _FRONT:])
    return lo + size - 1 - fetch_add(counters[at + _BACK:])


_F32_2D = numba.float32[:, ::1]
_F32_1D = numba.float32[::1]


@numba.njit(numba.void(_F32_2D, _F32_2D, _F32_1D, _F32_1D, numba.int64), parallel=True, fastmath={"contract"},
            cache=True, nogil=True)
def panel_matmul(out: np.ndarray, x: np.ndarray, panels: np.ndarray, bias: np.ndarray, threads: int) -> None:
    """``out [M, N] = x [M, K] @ W^T (+ bias)`` with ``W`` in ``pack_panels``' layout; ``bias`` empty for none."""
    rows, k = x.shape
    n = out.shape[1]
    units = (n + PANEL - 1) // PANEL
    has_bias = bias.shape[0] > 0
    # Every row's sums start from the bias (or zeros) in registers: out is written, never read.
    start = bias if has_bias else np.zeros(PANEL, dtype=np.float32)
    xf = x.ravel()
    of = out.ravel()
    # Every thread walks its own run of panels front to back, then helps with the others' from their backs: the
    # weights stream from memory in long runs, and a thread that loses its core for a while (to the scheduler,
    # Redis or the clients beside the worker) leaves its remaining panels to the other instead of holding the
    # region at its end. Against panels handed out one at a time from a shared counter, which interleaves the two
    # threads' reads: one row over the default model's 30 gate/up weights (212 MB), 3.9 ms (54 GB/s, torch's sum
    # over the same bytes) against 4.9 ms (43 GB/s); at 64 rows the same 30.6 ms, and 32.1-32.5 against 35.1-35.7
    # beside a process busy 1 ms in every 13; through the services a one-sequence step of 16.9-21.5 ms against
    # 22.5-24.8 (docs/benchmarks-history.md).
    counters = np.zeros(threads * _SEGMENT_STRIDE, dtype=np.int64)
    for t in numba.prange(threads):
        for step in range(threads):
            segment = (t + step) % threads
            lo = segment * units // threads
            size = (segment + 1) * units // threads - lo
            while True:
                u = _next_panel(counters, segment, lo, size, step == 0)
                if u < 0:
                    break
                col = u * PANEL
                width = min(PANEL, n - col)
                _strip(of, col, n, start, col if has_bias else 0, xf, k, rows, panels, col * k, width)
