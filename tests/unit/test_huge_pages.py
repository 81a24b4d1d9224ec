"""The CPU KV cache asks for transparent huge pages before it is first written (kernels/huge_pages.py).

Whether the kernel then backs it with 2 MiB pages depends on free contiguous memory, so the tests
check what is deterministic: the advice reaches the mapping (``hg`` among the VMA's flags in
/proc/self/smaps, set by MADV_HUGEPAGE), and the cache is still all zeros.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmserve.kernels import huge_pages
from llmserve.kernels.layout import allocate_kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(),
                               reason="transparent huge pages are a Linux kernel feature, not built in here")


def vma_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_kv_cache_mapping_is_advised_huge_and_zeroed() -> None:
    # 30 layers x 64 blocks x 3 kv heads x 64 dims x 16 slots, float32: 23.6 MB per kind, many 2 MiB pages.
    keys, values = allocate_kv_cache(30, 64, 3, 64, 16, torch.float32, "cpu")
    for caches in (keys, values):
        middle = caches[15].data_ptr()
        assert "hg" in vma_flags(middle)
        assert all(not cache.any() for cache in caches)


@needs_thp
def test_advice_covers_whole_huge_pages_only() -> None:
    big = torch.empty(5 << 20, dtype=torch.uint8)  # holds at least one whole, aligned 2 MiB page
    assert huge_pages.advise_huge_pages(big)
    small = torch.empty(1 << 20, dtype=torch.uint8)  # no whole 2 MiB page inside it
    assert not huge_pages.advise_huge_pages(small)


def test_tensors_off_the_cpu_are_left_alone() -> None:
    assert not huge_pages.advise_huge_pages(torch.empty(4 << 20, dtype=torch.uint8, device="meta"))
    keys, values = allocate_kv_cache(2, 8, 2, 64, 16, torch.float32, "meta")
    assert keys[0].device.type == values[0].device.type == "meta"
