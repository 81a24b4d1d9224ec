"""Warp shuffles for numba's CUDA simulator, which does not provide any.

The simulator runs each CUDA thread of a block as a Python thread. A shuffle
is emulated faithfully enough to test the real kernels: the 32 lanes of a warp
publish their values, meet at a barrier, and read their source lane's value.
Consecutive shuffles alternate between two sets of slots, so one barrier per
shuffle suffices: no lane can publish into a set again before every lane has
passed the next shuffle's barrier, i.e. finished reading. A warp whose lanes do
not all reach the shuffle (divergence: undefined behaviour on a GPU) fails with
a timeout instead of producing a plausible result.

Only the full-warp mask is supported, which is the only one the kernels use.
Relies on two simulator internals: each simulated thread's ``thread_id`` and
its ``_manager`` (one per executing block).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

_WARP_SIZE = 32
_FULL_MASK = 0xFFFFFFFF
# Long enough for a slow, heavily loaded machine; a real deadlock fails the test.
_BARRIER_TIMEOUT_S = 120.0


class _WarpSlots:
    def __init__(self) -> None:
        self.barrier = threading.Barrier(_WARP_SIZE, timeout=_BARRIER_TIMEOUT_S)
        self.values: tuple[list[object], list[object]] = ([None] * _WARP_SIZE, [None] * _WARP_SIZE)
        # Per lane: how many shuffles it has done (its parity picks the slot set).
        self.generation = [0] * _WARP_SIZE


_lock = threading.Lock()
# Executing block (the simulator's BlockManager) -> warp index -> its exchange slots.
_blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _warp_slots() -> tuple[_WarpSlots, int]:
    thread = threading.current_thread()
    manager = thread._manager
    warp, lane = divmod(thread.thread_id, _WARP_SIZE)
    with _lock:
        warps = _blocks.get(manager)
        if warps is None:
            if math.prod(manager._block_dim) % _WARP_SIZE != 0:
                raise NotImplementedError("simulated shuffles need blocks of whole warps (multiples of 32 threads)")
            warps = _blocks[manager] = {}
        slots = warps.get(warp)
        if slots is None:
            slots = warps[warp] = _WarpSlots()
    return slots, lane


def _shuffle(mask: int, value: object, source_lane: Callable[[int], int]) -> object:
    if mask != _FULL_MASK:
        raise NotImplementedError(f"simulated shuffles support only the full-warp mask, got {mask:#x}")
    slots, lane = _warp_slots()
    values = slots.values[slots.generation[lane] % 2]
    slots.generation[lane] += 1
    values[lane] = value
    slots.barrier.wait()
    return values[source_lane(lane)]


def shfl_sync(mask: int, value: object, src_lane: int) -> object:
    """``value`` of lane ``src_lane`` (mod 32), like ``numba.cuda.shfl_sync``."""
    return _shuffle(mask, value, lambda lane: int(src_lane) % _WARP_SIZE)


def shfl_xor_sync(mask: int, value: object, lane_mask: int) -> object:
    """``value`` of lane ``laneid ^ lane_mask``, like ``numba.cuda.shfl_xor_sync``."""
    return _shuffle(mask, value, lambda lane: (lane ^ int(lane_mask)) % _WARP_SIZE)
