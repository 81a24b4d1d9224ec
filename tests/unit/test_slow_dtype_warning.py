"""A 16-bit --dtype on a CPU without 16-bit matmul kernels is served, with a warning that says why it is slow."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from worker_service.config import WorkerConfig
from worker_service.models import linear
from worker_service.models.linear import slow_dtype_warning
from worker_service.model_runner import ModelRunner

CPU = torch.device("cpu")


@pytest.fixture
def no_16bit_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "onednn_has_kernels", lambda dtype: False)


@pytest.mark.usefixtures("no_16bit_kernels")
@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_16bit_without_kernels_is_named_with_the_way_out(dtype: torch.dtype, name: str) -> None:
    message = slow_dtype_warning(dtype, CPU)
    assert message is not None
    assert f"--dtype {name}" in message
    assert "--dtype float32" in message
    assert torch.backends.cpu.get_cpu_capability() in message


def test_float16_without_its_kernels_points_to_bfloat16_where_this_cpu_has_those(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An AMD Zen 4: AVX512-BF16 without AVX512-FP16. The fp16 message must not name bf16's instructions as
    # what fp16 lacks, and it offers bf16 as the 16-bit choice.
    monkeypatch.setattr(linear, "onednn_has_kernels", lambda dtype: dtype == torch.bfloat16)
    assert slow_dtype_warning(torch.bfloat16, CPU) is None
    message = slow_dtype_warning(torch.float16, CPU)
    assert message is not None
    assert "AVX512-FP16" in message and "AVX512-BF16" not in message
    assert "--dtype bfloat16" in message and "--dtype float32" in message


@pytest.mark.usefixtures("no_16bit_kernels")
def test_without_any_16bit_kernels_float32_is_the_only_way_out() -> None:
    bf16, fp16 = slow_dtype_warning(torch.bfloat16, CPU), slow_dtype_warning(torch.float16, CPU)
    assert bf16 is not None and fp16 is not None
    assert "AVX512-BF16" in bf16 and "AVX512-FP16" in fp16
    assert "use --dtype float32" in bf16 and "use --dtype float32" in fp16


@pytest.mark.usefixtures("no_16bit_kernels")
def test_float32_and_gpus_never_warn() -> None:
    assert slow_dtype_warning(torch.float32, CPU) is None
    assert slow_dtype_warning(torch.bfloat16, torch.device("cuda")) is None


def test_16bit_with_kernels_does_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "onednn_has_kernels", lambda dtype: True)
    assert slow_dtype_warning(torch.bfloat16, CPU) is None
    assert slow_dtype_warning(torch.float16, CPU) is None


def test_the_answer_follows_this_cpus_onednn() -> None:
    # Whatever this machine is: the warning appears exactly when oneDNN says it has no bf16 kernels.
    supported = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (slow_dtype_warning(torch.bfloat16, CPU) is None) == supported


@pytest.mark.usefixtures("no_16bit_kernels")
def test_the_worker_logs_it_at_start(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="worker_service.model_runner"):
        runner = ModelRunner(WorkerConfig(model=str(tiny_llama_dir), num_gpu_blocks_override=16, max_model_len=64,
                                          block_size=8, dtype="bfloat16"))
    assert runner.dtype == torch.bfloat16
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("--dtype bfloat16" in m for m in warnings), warnings
