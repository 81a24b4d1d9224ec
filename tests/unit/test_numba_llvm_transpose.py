"""The prefill kernel's register transpose (kernels/cpu/_numba_llvm.py transpose_tile) against numpy."""

from __future__ import annotations

import numba
import numpy as np

from llmserve.kernels.cpu._numba_llvm import TRANSPOSE_LANES, transpose_tile


@numba.njit
def _transpose(dst: np.ndarray, dst_at: int, dst_step: int, src: np.ndarray, src_at: int, src_step: int,
               factors: np.ndarray, factors_at: int) -> None:
    transpose_tile(dst, dst_at, dst_step, src, src_at, src_step, factors, factors_at)


def test_a_tile_lands_transposed_and_scaled_at_any_offsets_and_strides() -> None:
    lanes = TRANSPOSE_LANES
    rng = np.random.default_rng(0)
    src = rng.standard_normal(40 * 23).astype(np.float32)
    factors = rng.standard_normal(30).astype(np.float32)
    dst = np.full(50 * 21, np.nan, dtype=np.float32)
    _transpose(dst, 3, 21, src, 5, 23, factors, 7)
    expected = np.full_like(dst, np.nan)
    for r in range(lanes):
        for c in range(lanes):
            expected[3 + c * 21 + r] = src[5 + r * 23 + c] * factors[7 + c]
    # Bit for bit (one rounding per element, as the scalar product), and nothing outside the tile written.
    np.testing.assert_array_equal(dst, expected)


def test_a_strided_source_is_read_from_its_first_element() -> None:
    # The query is a view of the fused q/k/v rows: [tokens, heads, dim] with a row stride wider than heads * dim.
    lanes = TRANSPOSE_LANES
    rng = np.random.default_rng(1)
    fused = rng.standard_normal((20, 5 * lanes)).astype(np.float32)
    query = fused[:, lanes:4 * lanes].reshape(20, 3, lanes)
    assert not query.flags.c_contiguous
    step = query.strides[0] // query.itemsize
    dst = np.zeros(lanes * lanes, dtype=np.float32)
    ones = np.ones(lanes, dtype=np.float32)
    _transpose(dst, 0, lanes, query, 2 * step + 1 * lanes, step, ones, 0)  # tokens 2..17 of head 1
    np.testing.assert_array_equal(dst.reshape(lanes, lanes), query[2:18, 1, :].T)
