"""Reading paged-cache blocks in the Numba attention kernels, and the multiply-add they run over a block's rows.

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

from kernels.cpu._numba_llvm import fma_lanes


def as_float32(block: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """One cache block (any shape) as float32: itself, or widened from bf16 into the scratch ``bits``."""
    raise NotImplementedError("only callable from jitted code")


def flat_block(cache: np.ndarray, at: int, bits: np.ndarray) -> tuple[np.ndarray, int]:
    """The block of the flat cache ``cache`` at ``at`` as float32: ``(array, offset of the block in it)``.

    float32: the cache itself and ``at``; bf16: the scratch ``bits`` (one block of uint32) widened, and 0.
    """
    raise NotImplementedError("only callable from jitted code")


@numba.njit(inline="always", cache=True)
def _widen_bf16(flat: np.ndarray, at: int, bits: np.ndarray) -> np.ndarray:
    for i in range(bits.shape[0]):
        # bf16 is the top half of a float32: its 16 bits shifted up are exactly that float.
        bits[i] = np.uint32(np.uint16(flat[at + i])) << np.uint32(16)
    return bits.view(np.float32)


@overload(as_float32, inline="always")
def _as_float32_typed(block: types.Array, bits: types.Array) -> object:
    if isinstance(block.dtype, types.Integer):

        def widen(block: types.Array, bits: types.Array) -> np.ndarray:
            return _widen_bf16(block.reshape(bits.shape[0]), 0, bits).reshape(block.shape)

        return widen

    def as_is(block: types.Array, bits: types.Array) -> np.ndarray:
        return block

    return as_is


@overload(flat_block, inline="always")
def _flat_block_typed(cache: types.Array, at: types.Integer, bits: types.Array) -> object:
    if isinstance(cache.dtype, types.Integer):

        def widen(cache: types.Array, at: types.Integer, bits: types.Array) -> tuple[np.ndarray, int]:
            return _widen_bf16(cache, at, bits), 0

        return widen

    def in_place(cache: types.Array, at: types.Integer, bits: types.Array) -> tuple[np.ndarray, int]:
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
def axpy(acc: np.ndarray, acc_at: int, a: np.ndarray, a_at: int, b: np.ndarray, b_at: int, n: int) -> None:
    """``acc[acc_at + i] += a[a_at + i] * b[b_at + i]`` for ``i < n`` (flat C-contiguous float32 arrays).

    Whole 16- or 8-lane vectors where ``n`` allows (block sizes 8, 16, 32 and their rows), else element by element.
    """
    if n % 16 == 0:
        for i in range(0, n, 16):
            fma_lanes(acc, acc_at + i, a, a_at + i, b, b_at + i, 16)
    elif n % 8 == 0:
        for i in range(0, n, 8):
            fma_lanes(acc, acc_at + i, a, a_at + i, b, b_at + i, 8)
    else:
        for i in range(n):
            acc[acc_at + i] += a[a_at + i] * b[b_at + i]
