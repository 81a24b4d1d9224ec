"""Loading fp16 / bf16 / fp32 elements as float32 and storing float32 results back, inside kernels.

fp16 and fp32 are native Numba types: a cast converts them. bf16 is not, so
bf16 tensors reach the kernels as int16 bit patterns (see ``kernel_array``) and
are converted by hand:

    bf16 -> fp32:  the bf16 bits are the top half of the fp32 bits (bits << 16)
    fp32 -> bf16:  keep the top half, rounded to nearest, ties to even:
                   (bits + 0x7FFF + lsb_of_top_half) >> 16; NaN -> quiet NaN

Reinterpreting bits as a float is ``libdevice.int_as_float`` on a GPU; the
simulator runs kernels as Python, so there it is a NumPy scalar view.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import float32, int16, int32
from numba.types import float16

from llmserve.kernels.cuda._device import SIMULATOR, device_function

if SIMULATOR:

    def _int_as_float(bits):
        return np.int32(bits).view(np.float32)

    def _float_as_int(value):
        return np.float32(value).view(np.int32)

else:
    from numba.cuda import libdevice

    _int_as_float = libdevice.int_as_float
    _float_as_int = libdevice.float_as_int

# A quiet NaN: what rounding a NaN to bf16 gives (its payload is not kept).
_BF16_NAN = 0x7FC0


@device_function
def native_to_f32(value):
    """fp16 or fp32 element -> float32."""
    return float32(value)


@device_function
def bf16_to_f32(bits):
    """bf16 element (its int16 bit pattern) -> float32."""
    # int16 -> int32 sign-extends, and bits * 2^16 always fits in int32, so
    # the shift yields exactly the fp32 bit pattern whatever the sign bit.
    return _int_as_float(int32(bits) << 16)


@device_function
def f32_to_f32(value):
    return float32(value)


@device_function
def f32_to_f16(value):
    return float16(value)


@device_function
def f32_to_bf16(value):
    """float32 -> bf16 bit pattern (int16), rounded to nearest even."""
    if value != value:
        return int16(_BF16_NAN)
    bits = _float_as_int(float32(value))
    # No overflow for any finite or infinite input: the largest, 0x7F7FFFFF + 0x8000, is below 2^31.
    return int16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


# Element loaders and storers per tensor dtype; the kernels are specialized on them.
LOADERS = {torch.float32: native_to_f32, torch.float16: native_to_f32, torch.bfloat16: bf16_to_f32}
STORERS = {torch.float32: f32_to_f32, torch.float16: f32_to_f16, torch.bfloat16: f32_to_bf16}
SUPPORTED_DTYPES = tuple(LOADERS)
