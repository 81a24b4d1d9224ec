"""Warp-level reductions with shuffles (no shared memory, no block barrier).

The shuffles are imported by name (the simulator's emulation, or numba's), so
these helpers never touch the ``cuda`` module and can run as plain Python
under the simulator (see ``device_function``).
"""

from __future__ import annotations

from llmserve.kernels.cuda._device import SIMULATOR, device_function

if SIMULATOR:
    from llmserve.kernels.cuda._simulator import shfl_sync, shfl_xor_sync
else:
    from numba.cuda import shfl_sync, shfl_xor_sync

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF

__all__ = ["FULL_MASK", "WARP_SIZE", "shfl_sync", "xor_max", "xor_sum"]


@device_function
def xor_sum(value, width):
    """Sum of ``value`` over each aligned group of ``width`` lanes (a power of two <= 32); every lane gets it."""
    # Butterfly: after the step with mask m, each lane holds the sum over the
    # 2m lanes that differ from it only in bits below 2m.
    mask = width // 2
    while mask >= 1:
        value += shfl_xor_sync(FULL_MASK, value, mask)
        mask //= 2
    return value


@device_function
def xor_max(value, width):
    """Maximum of ``value`` over each aligned group of ``width`` lanes; every lane gets it."""
    mask = width // 2
    while mask >= 1:
        other = shfl_xor_sync(FULL_MASK, value, mask)
        if other > value:
            value = other
        mask //= 2
    return value
