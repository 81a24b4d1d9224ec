"""Reading paged-cache blocks in the Numba attention kernels, and the weighted sums they run over blocks' rows.

Caches come as float32, or as bf16 viewed as int16 (Numba has no bf16): a float32
block is read where it lies, a bf16 one is widened into a small scratch first. Which
of the two a function compiles to is picked per cache dtype at compile time (the
overloads below), so the kernels' code is written once for both.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from llmserve.kernels.cpu._numba_llvm import fma_sum_lanes
from llmserve.kernels.cpu.host_cpu import has_avx512
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

# Several query heads' running sums side by side in registers (weighted_sums): where there are 32 of them.
_HEAD_TILES = has_avx512()


def as_float32(block: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """One cache block (any shape) as float32: itself, or widened from bf16 into the scratch ``bits``."""
    raise NotImplementedError("only callable from jitted code")


def flat_block(cache: np.ndarray, at: int, size: int, bits: np.ndarray, bits_at: int) -> tuple[np.ndarray, int]:
    """The ``size`` elements of the flat cache ``cache`` from ``at`` as float32: ``(array, offset of them in it)``.

    float32: the cache itself and ``at``; bf16: the uint32 scratch ``bits``, widened into from ``bits_at``, and
    ``bits_at`` (several blocks can be widened side by side into one scratch).
    """
    raise NotImplementedError("only callable from jitted code")


@numba.njit(inline="always", cache=True)
def _widen_bf16(flat: np.ndarray, at: int, bits: np.ndarray, bits_at: int, size: int) -> np.ndarray:
    # Slice views indexed from 0: indexed at ``at + i``, Numba's wrap of negative indices kept the loop scalar
    # (~1.1-1.9 us per 1024 elements against ~0.14 us vectorized, on an AVX-512 Xeon).
    src, dst = flat[at:at + size], bits[bits_at:bits_at + size]
    for i in range(src.shape[0]):
        # bf16 is the top half of a float32: its 16 bits shifted up are exactly that float.
        dst[i] = np.uint32(np.uint16(src[i])) << np.uint32(16)
    return bits.view(np.float32)


@overload(as_float32, inline="always")
def _as_float32_typed(block: types.Array, bits: types.Array) -> object:
    if isinstance(block.dtype, types.Integer):

        def widen(block: types.Array, bits: types.Array) -> np.ndarray:
            return _widen_bf16(block.reshape(bits.shape[0]), 0, bits, 0, bits.shape[0]).reshape(block.shape)

        return widen

    def as_is(block: types.Array, bits: types.Array) -> np.ndarray:
        return block

    return as_is


@overload(flat_block, inline="always")
def _flat_block_typed(cache: types.Array, at: types.Integer, size: types.Integer, bits: types.Array,
                      bits_at: types.Integer) -> object:
    if isinstance(cache.dtype, types.Integer):

        def widen(cache: types.Array, at: types.Integer, size: types.Integer, bits: types.Array,
                  bits_at: types.Integer) -> tuple[np.ndarray, int]:
            return _widen_bf16(cache, at, bits, bits_at, size), bits_at

        return widen

    def in_place(cache: types.Array, at: types.Integer, size: types.Integer, bits: types.Array,
                 bits_at: types.Integer) -> tuple[np.ndarray, int]:
        return cache, at

    return in_place


@numba.njit(inline="always", cache=True)
def finite_slots(values: np.ndarray, lo: int, hi: int, scratch: np.ndarray) -> np.ndarray:
    """``values`` ``[D, BS]`` with the slots outside ``lo:hi`` zeroed (in ``scratch``) when there are any.

    Slots of a partly used block may be unwritten (NaN in tests), and a loop over
    whole blocks would compute probability 0 times NaN = NaN.
    """
    if lo == 0 and hi == values.shape[1]:
        return values
    scratch[:] = 0.0
    for d in range(values.shape[0]):
        for o in range(lo, hi):
            scratch[d, o] = values[d, o]
    return scratch


@numba.njit(inline="always", fastmath={"contract"}, cache=True)
def weighted_sum(acc: np.ndarray, acc_at: int, a: np.ndarray, a_at: int, a_step: int, width: int, b: np.ndarray,
                 b_at: int, b_offsets: np.ndarray, count: int, n: int) -> None:
    """``acc[acc_at + i] += sum_{c < count} a[a_at + c * a_step + i % width] * b[b_offsets[c] + b_at + i]``, ``i < n``.

    ``b`` rows (key or value block rows, anywhere in the cache: ``b_offsets``) weighted by a ``width``-long
    pattern of ``a`` repeated along them (a query chunk against a key row of slots; a block's softmax
    weights against value rows). Summed in order of ``c``, one rounding per multiply-add, the running sums in
    registers (``_weighted_lanes``) for widths 4, 8, 16 and 32, else element by element.
    """
    if width == 4:
        _weighted_lanes(acc, acc_at, a, a_at, a_step, 4, b, b_at, b_offsets, count, n)
    elif width == 8:
        _weighted_lanes(acc, acc_at, a, a_at, a_step, 8, b, b_at, b_offsets, count, n)
    elif width == 16:
        _weighted_lanes(acc, acc_at, a, a_at, a_step, 16, b, b_at, b_offsets, count, n)
    elif width == 32:
        _weighted_lanes(acc, acc_at, a, a_at, a_step, 32, b, b_at, b_offsets, count, n)
    else:
        _weighted_elements(acc, acc_at, a, a_at, a_step, width, b, b_at, b_offsets, count, n)


@numba.njit(inline="always", fastmath={"contract"}, cache=True)
def _weighted_lanes(acc: np.ndarray, acc_at: int, a: np.ndarray, a_at: int, a_step: int, width: int, b: np.ndarray,
                    b_at: int, b_offsets: np.ndarray, count: int, n: int) -> None:
    """``weighted_sum`` for a literal ``width``: 64 lanes at a time (four independent 16-lane chains, which hide
    the FMA's latency) where ``n`` allows, else 32, else element by element."""
    if n % 64 == 0:
        for i in range(0, n, 64):
            fma_sum_lanes(acc, acc_at + i, 0, a, a_at, 0, a_step, b, b_at + i, b_offsets, count, 64, width, 1)
    elif n % 32 == 0:
        for i in range(0, n, 32):
            fma_sum_lanes(acc, acc_at + i, 0, a, a_at, 0, a_step, b, b_at + i, b_offsets, count, 32, width, 1)
    else:
        _weighted_elements(acc, acc_at, a, a_at, a_step, width, b, b_at, b_offsets, count, n)


@numba.njit(inline="always", cache=True)
def head_tile(group: int) -> int:
    """Query heads per ``weighted_sums`` call for a GQA ``group`` (query heads per kv head): 4, 3, 2, or 1 for
    one head at a time (``weighted_sum``).

    AVX-512 only: a tile of 4 heads holds 16 of its 32 vector registers of running sums (64 lanes each);
    AVX2 has 16 registers, half of which one head's 64 lanes already take.
    """
    if not _HEAD_TILES:
        return 1
    for tile in (4, 3, 2):
        if group % tile == 0:
            return tile
    return 1


@numba.njit(inline="always", fastmath={"contract"}, cache=True)
def weighted_sums(acc: np.ndarray, acc_at: int, acc_head: int, a: np.ndarray, a_at: int, a_head: int, a_step: int,
                  width: int, b: np.ndarray, b_at: int, b_offsets: np.ndarray, count: int, n: int, heads: int) -> None:
    """``weighted_sum`` for a tile of ``heads`` (2, 3 or 4) query heads of one kv head: head ``h`` adds into
    ``acc`` from ``acc_at + h * acc_head`` its pattern of ``a`` from ``a_at + h * a_head`` against the same ``b``.

    ``width`` is a literal and ``n`` a multiple of 64 (the caller checks both). Each ``b`` vector is loaded once
    for the whole tile: the decode kernel's key loop, reading a block row once per query head, was bound by
    its loads (on a Zen 4, 64 lanes x 16 rows took 134 cycles for one head alone, 70 a head in a tile of 3).
    Each head's sums are the same chain of multiply-adds as in ``weighted_sum``: bit-identical results.
    Each (width, tile) pair compiles to its own loop, so the kernel compiles only the few it passes.
    """
    if heads == 2:
        for i in range(0, n, 64):
            fma_sum_lanes(acc, acc_at + i, acc_head, a, a_at, a_head, a_step, b, b_at + i, b_offsets, count, 64,
                          width, 2)
    elif heads == 3:
        for i in range(0, n, 64):
            fma_sum_lanes(acc, acc_at + i, acc_head, a, a_at, a_head, a_step, b, b_at + i, b_offsets, count, 64,
                          width, 3)
    else:
        for i in range(0, n, 64):
            fma_sum_lanes(acc, acc_at + i, acc_head, a, a_at, a_head, a_step, b, b_at + i, b_offsets, count, 64,
                          width, 4)


@numba.njit(inline="always", fastmath={"contract"}, cache=True)
def _weighted_elements(acc: np.ndarray, acc_at: int, a: np.ndarray, a_at: int, a_step: int, width: int,
                       b: np.ndarray, b_at: int, b_offsets: np.ndarray, count: int, n: int) -> None:
    for c in range(count):
        for i in range(n):
            acc[acc_at + i] += a[a_at + c * a_step + i % width] * b[b_offsets[c] + b_at + i]
