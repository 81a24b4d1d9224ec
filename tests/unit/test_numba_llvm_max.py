"""The vector-lane maximum (kernels/cpu/_numba_llvm.py max_lanes, the kernels' max_of) against numpy."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from llmserve.kernels.cpu._numba_decode import max_of
from llmserve.kernels.cpu._numba_llvm import max_lanes


@numba.njit
def _max(values: np.ndarray, at: int, count: int) -> np.float32:
    return max_lanes(values, at, count)


# Every path: nothing, the scalar tail alone, whole 16-lane pieces, whole 64-element steps, and all three; a vocabulary.
@pytest.mark.parametrize("count", [0, 1, 7, 15, 16, 17, 31, 48, 63, 64, 65, 80, 127, 128, 129, 1000, 49152])
@pytest.mark.parametrize("at", [0, 3])
def test_the_maximum_of_any_run_is_numpy_s(count: int, at: int) -> None:
    rng = np.random.default_rng(count * 7 + at)
    values = rng.standard_normal(at + count + 5).astype(np.float32)
    # Elements outside the run are larger than any inside: reading past either end would show.
    values[:at] = 100.0
    values[at + count:] = 100.0
    expected = values[at:at + count].max() if count else np.float32(-np.inf)
    assert _max(values, at, count) == expected
    assert max_of(values, at, count) == expected


@pytest.mark.parametrize("where", [0, 15, 16, 63, 64, 99])
def test_the_maximum_is_found_in_every_lane_and_chain(where: int) -> None:
    values = np.full(100, -np.inf, dtype=np.float32)
    values[where] = -3.5
    assert _max(values, 0, 100) == np.float32(-3.5)


def test_an_all_minus_infinity_run_and_a_nan_are_handled() -> None:
    # Masked softmax scores: a span may hold -inf only (its maximum is -inf, not a NaN).
    assert _max(np.full(70, -np.inf, dtype=np.float32), 0, 70) == -np.inf
    values = np.arange(70, dtype=np.float32)
    values[69] = np.nan
    values[3] = np.nan
    # A NaN is skipped (llvm.maxnum): the maximum of the others.
    assert _max(values, 0, 70) == np.float32(68.0)
