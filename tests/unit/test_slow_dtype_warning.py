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
