"""kernels.cpu.host_cpu: the CPU facts kernel choices key on, from LLVM's view of the host."""

from __future__ import annotations

import pytest

from llmserve.kernels.cpu import host_cpu


@pytest.mark.parametrize(("name", "avx512", "amd_avx512"), [
    ("znver4", True, True), ("znver5", True, True), ("znver3", False, False), ("sapphirerapids", True, False),
    ("skylake", False, False),
])
def test_amd_avx512_is_an_amd_core_name_with_avx512(monkeypatch: pytest.MonkeyPatch, name: str, avx512: bool,
                                                    amd_avx512: bool) -> None:
    monkeypatch.setattr(host_cpu.llvm, "get_host_cpu_name", lambda: name)
    monkeypatch.setattr(host_cpu.llvm, "get_host_cpu_features", lambda: {"avx512f": avx512})
    for cached in (host_cpu.has_avx512, host_cpu.is_amd_avx512):
        cached.cache_clear()
    try:
        assert host_cpu.has_avx512() == avx512
        assert host_cpu.is_amd_avx512() == amd_avx512
    finally:
        for cached in (host_cpu.has_avx512, host_cpu.is_amd_avx512):
            cached.cache_clear()
