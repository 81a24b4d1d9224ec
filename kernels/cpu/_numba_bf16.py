"""bf16 elements in Numba kernels, which have no bf16 type: a bf16 array reaches them viewed as int16.

``widen`` reads one element as float32 (a float32 element as it is); ``narrow_to`` converts a float32
value to an array's element type: a bf16 array gets it rounded to the nearest bf16, ties to even, as
torch's ``.to(torch.bfloat16)`` rounds it; an array of the value's own type gets it unchanged. Both
are picked per type at compile time, so a kernel written with them compiles to plain loads and stores
for float32 (and for bits copied between arrays of one type) and to the conversion for bf16.
"""

from __future__ import annotations

import numpy as np
from numba.core import types
from numba.extending import overload

from llmserve.kernels.cpu._numba_llvm import bits_from_float, float_from_bits
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()


def widen(element: object) -> float:
    """One array element as float32: bf16 bits (int16) widened exactly, a float32 as it is."""
    raise NotImplementedError("only callable from jitted code")


def narrow_to(value: object, array: np.ndarray) -> object:
    """``value`` as an element of ``array``: rounded to bf16 bits for an int16 (bf16) array and a float32
    value, unchanged when ``array`` holds ``value``'s own type."""
    raise NotImplementedError("only callable from jitted code")


def _is_bf16_bits(numba_type: types.Type) -> bool:
    return isinstance(numba_type, types.Integer) and numba_type.bitwidth == 16


@overload(widen, inline="always")
def _widen_typed(element: types.Type) -> object:
    if _is_bf16_bits(element):

        def from_bits(element: types.Type) -> float:
            # bf16 is the top half of a float32: its 16 bits shifted up are exactly that float.
            return float_from_bits(np.int32(np.uint32(np.uint16(element)) << np.uint32(16)))

        return from_bits
    if element == types.float32:

        def as_is(element: types.Type) -> float:
            return element

        return as_is
    return None


@overload(narrow_to, inline="always")
def _narrow_to_typed(value: types.Type, array: types.Array) -> object:
    # Numba matches an implementation to its overload by parameters, annotations included.
    if value == array.dtype:

        def unchanged(value: types.Type, array: types.Array) -> object:
            return value

        return unchanged
    if value == types.float32 and _is_bf16_bits(array.dtype):

        def to_bits(value: types.Type, array: types.Array) -> object:
            bits = np.int64(bits_from_float(value)) & 0xFFFFFFFF
            if bits & 0x7FFFFFFF > 0x7F800000:
                # NaN stays a (quiet) NaN: rounding could carry its low mantissa bits into infinity.
                return np.int16(np.uint16((bits >> 16) | 0x40))
            # Round to nearest, ties to the even upper half; a carry out of the mantissa raises the exponent,
            # up to infinity past bf16's largest finite value, as torch's conversion does.
            return np.int16(np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16))

        return to_bits
    return None
