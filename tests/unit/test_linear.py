"""worker_service.models.linear: the packed oneDNN projection against float64, and its dense fallback."""

from __future__ import annotations

import pytest
import torch

from worker_service.models import linear as linear_module
from worker_service.models._numba_panels import pack_panels, panel_matmul
from worker_service.models.linear import Linear


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.double() @ weight.double().T + (bias.double() if bias is not None else 0)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 17, linear_module.PACK_ROWS_HINT, 130, 200, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_float32_matches_float64(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(333, 576)  # a feature count no SIMD width divides
    bias = torch.randn(333) if with_bias else None
    projection = Linear(weight, bias)
    assert projection.packed
    x = torch.randn(rows, 576)
    # float32 sums of 576 products of unit normals: errors ~ sqrt(576) * 2^-24 * |terms|.
    torch.testing.assert_close(projection(x).double(), _reference(x, weight, bias), rtol=1e-5, atol=3e-4)


@pytest.mark.skipif(not linear_module.onednn_has_kernels(torch.bfloat16),
                    reason="oneDNN has no bf16 GEMM on this CPU (AVX-512 BF16 / AMX): bf16 weights stay dense")
def test_packed_bfloat16_matches_f_linear() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    projection = Linear(weight)
    assert projection.packed
    # Both are oneDNN bf16 GEMMs with float32 accumulation; one rounding of the output apart at most.
    torch.testing.assert_close(projection(x), torch.nn.functional.linear(x, weight), rtol=2**-7, atol=1e-2)


def test_empty_input_gives_empty_output() -> None:
    projection = Linear(torch.randn(7, 4))
    assert projection(torch.empty(0, 4)).shape == (0, 7)


def test_unpackable_weight_keeps_dense_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "_PACKABLE_DTYPES", ())
    weight, bias, x = torch.randn(10, 8), torch.randn(10), torch.randn(3, 8)
    projection = Linear(weight, bias)
    assert not projection.packed
    torch.testing.assert_close(projection(x), torch.nn.functional.linear(x, weight, bias))


def test_wrong_input_width_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="projection of 8 features got input of shape \\(3, 9\\)"):
        Linear(torch.randn(10, 8))(torch.randn(3, 9))


def test_bucket_rows_bounds_the_row_counts_and_the_padding() -> None:
    buckets = {linear_module.bucket_rows(rows) for rows in range(1, 2049)}
    # 16 exact, then steps of 8 to 128, 16 to 512 and 64 to 2048: oneDNN builds one primitive per bucket.
    assert len(buckets) == 16 + 14 + 24 + 24
    for rows in range(1, 2049):
        padded = linear_module.bucket_rows(rows)
        assert rows <= padded <= (rows * 1.125 if rows >= 64 else rows + 7)


# Panel layouts: whole 48-column panels only, and a narrower last panel of 32 or 16 columns.
PANEL_SHAPES = [(96, 64), (80, 576), (64, 200), (1536, 576)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8, 13, 64, 71])
@pytest.mark.parametrize("shape", PANEL_SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_panels_float32_match_float64(rows: int, shape: tuple[int, int], with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(*shape)
    bias = torch.randn(shape[0]) if with_bias else None
    projection = Linear(weight, bias, panels=True)
    assert projection.kernel == "panels" and projection.packed
    x = torch.randn(rows, shape[1])
    # One float32 multiply-add chain per element: error ~ sqrt(K) * 2^-24 * |terms|, as for oneDNN above.
    torch.testing.assert_close(projection(x).double(), _reference(x, weight, bias), rtol=1e-5, atol=3e-4)


def test_panels_give_each_row_the_same_result_alone_or_in_a_batch() -> None:
    torch.manual_seed(0)
    projection = Linear(torch.randn(1536, 576), torch.randn(1536), panels=True)
    batch = torch.randn(39, 576)  # tiles of 8, 8, 8, 8, 4, 3
    together = projection(batch)
    # Bit for bit: a row's sums do not depend on which row tile (8, 4, 3, 2 or 1) or thread computed them.
    for row in (0, 5, 32, 36, 38):
        assert torch.equal(projection(batch[row:row + 1]), together[row:row + 1])
    for start, stop in ((3, 15), (0, 2), (5, 8), (30, 37), (20, 26)):  # 8 + 4, 2, 3, 4 + 3, 4 + 2
        assert torch.equal(projection(batch[start:stop]), together[start:stop])


@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_matmul_writes_out_without_reading_it(with_bias: bool) -> None:
    """The sums start from the bias (or zero) in registers: whatever ``out`` held before is not added."""
    torch.manual_seed(0)
    weight, x = torch.randn(80, 64), torch.randn(13, 64)  # a 48-column panel and a 32-column one
    bias = torch.randn(80) if with_bias else None
    out = torch.full((13, 80), float("nan"))
    panel_bias = bias.numpy() if bias is not None else torch.empty(0).numpy()
    panel_matmul(out.numpy(), x.numpy(), pack_panels(weight), panel_bias, 2)
    torch.testing.assert_close(out.double(), _reference(x, weight, bias), rtol=1e-5, atol=3e-4)


@pytest.mark.parametrize("out_features", [16, 80, 480, 1552])  # 1, 2, 10 and 33 panels
def test_panel_matmul_reaches_every_panel_whatever_the_team(out_features: int) -> None:
    """Threads own runs of panels and help with the others' from their backs: with more threads than panels, or
    segments of uneven sizes, every output column is written, and by the same chain of multiply-adds."""
    torch.manual_seed(out_features)
    weight, x = torch.randn(out_features, 64), torch.randn(5, 64)
    panels, no_bias = pack_panels(weight), torch.empty(0).numpy()
    results = []
    for threads in (1, 2, 3, 4, 7):
        out = torch.full((5, out_features), float("nan"))
        panel_matmul(out.numpy(), x.numpy(), panels, no_bias, threads)
        results.append(out)
    torch.testing.assert_close(results[0].double(), _reference(x, weight, None), rtol=1e-5, atol=3e-4)
    for out in results[1:]:
        assert torch.equal(out, results[0])


def test_panels_take_an_empty_input() -> None:
    assert Linear(torch.randn(32, 8), panels=True)(torch.empty(0, 8)).shape == (0, 32)


def test_a_weight_panels_cannot_lay_out_goes_to_onednn_or_dense() -> None:
    weight, x = torch.randn(333, 64), torch.randn(5, 64)  # 333 is not whole 16-column vectors
    projection = Linear(weight, panels=True)
    assert projection.kernel != "panels"
    torch.testing.assert_close(projection(x).double(), _reference(x, weight, None), rtol=1e-5, atol=3e-4)
    assert Linear(torch.randn(32, 8).bfloat16(), panels=True).kernel != "panels"


def test_use_panels_follows_the_choice_dtype_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert linear_module.use_panels("panels", torch.float32, cpu)
    assert not linear_module.use_panels("onednn", torch.float32, cpu)
    assert not linear_module.use_panels("panels", torch.bfloat16, cpu)
    assert not linear_module.use_panels("panels", torch.float32, torch.device("cuda"))
    for amd_avx512 in (True, False):
        monkeypatch.setattr(linear_module, "is_amd_avx512", lambda a=amd_avx512: a)
        assert linear_module.use_panels("auto", torch.float32, cpu) == amd_avx512
    with pytest.raises(ValueError, match="cpu_matmul must be one of auto, onednn, panels, got 'mkl'"):
        linear_module.use_panels("mkl", torch.float32, cpu)
