"""The multiply-add peak's loop computes what it is timed for: every step of every accumulator, kept live."""

from __future__ import annotations

import ctypes

import numpy as np

from benchmarks import fma_peak


def test_the_timed_loop_runs_every_multiply_add_and_stores_their_sum() -> None:
    _engine, loop, lanes = fma_peak._compiled()
    out = (ctypes.c_float * lanes)()
    # Enough steps that skipping them shows: lane 0 grows by ~0.01 from 66, the other lanes hold 12 x ~steps x c,
    # which one step more or less moves by ~0.1 %.
    steps = 1000
    loop(steps, ctypes.addressof(out))
    b, c = np.float32(fma_peak._B), np.float32(fma_peak._C)

    def after(start: float) -> np.float32:
        value = np.float32(start)
        for _ in range(steps):
            # float32 x float32 is exact in float64: one rounding to float64, then to float32 (as an FMA's one,
            # but for a halfway case, hence the tolerance below).
            value = np.float32(np.float64(value) * np.float64(b) + np.float64(c))
        return value

    def summed(starts: list[float]) -> np.float32:
        total = after(starts[0]) + after(starts[1])
        for start in starts[2:]:
            total = np.float32(total + after(start))
        return total

    result = np.frombuffer(out, dtype=np.float32)
    np.testing.assert_allclose(result[0], summed([float(i) for i in range(fma_peak._ACCUMULATORS)]), rtol=1e-6)
    np.testing.assert_allclose(result[1:], summed([0.0] * fma_peak._ACCUMULATORS), rtol=1e-6)
    assert abs(result[0] - 66) > 0.005 and abs(result[1] - 12 * steps * c) < 1e-3 * 12 * steps * c
