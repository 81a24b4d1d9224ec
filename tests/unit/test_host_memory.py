"""shared.host_memory: the memory left to a worker, from /proc/meminfo and a container's cgroup (v2 or v1), and the
worker's refusal of a KV cache larger than that."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.host_memory import available_bytes
from worker_service.cache_engine import CacheSizeError, CacheSizing, check_host_memory

GIB = 1 << 30


def _root(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


MEMINFO = "MemTotal:       25000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\n"  # 20 GiB


def test_meminfo_alone(tmp_path: Path) -> None:
    assert available_bytes(_root(tmp_path, {"proc/meminfo": MEMINFO})) == 20 * GIB


def test_a_cgroup_v2_limit_counts_its_working_set(tmp_path: Path) -> None:
    """8 GiB limit, 5 GiB used of which 1 GiB is inactive page cache (reclaimed before an OOM kill): 4 GiB left."""
    root = _root(tmp_path, {"proc/meminfo": MEMINFO, "sys/fs/cgroup/memory.max": f"{8 * GIB}\n",
                            "sys/fs/cgroup/memory.current": f"{5 * GIB}\n",
                            "sys/fs/cgroup/memory.stat": f"anon 1234\ninactive_file {GIB}\nactive_file 5\n"})
    assert available_bytes(root) == 4 * GIB


def test_a_cgroup_v1_limit_and_the_machine_whichever_is_lower(tmp_path: Path) -> None:
    files = {"proc/meminfo": MEMINFO, "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{64 * GIB}\n",
             "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{2 * GIB}\n",
             "sys/fs/cgroup/memory/memory.stat": f"total_inactive_file {GIB}\n"}
    assert available_bytes(_root(tmp_path, files)) == 20 * GIB  # the machine's 20 GiB, below the cgroup's 63
    (tmp_path / "proc/meminfo").write_text(MEMINFO.replace("20971520", str(100 * 1024 * 1024)))
    assert available_bytes(tmp_path) == 63 * GIB


@pytest.mark.parametrize("limit", ["max", str((1 << 63) - 4096)])  # v2's and v1's "no limit"
def test_no_cgroup_limit(limit: str, tmp_path: Path) -> None:
    name = "sys/fs/cgroup/memory.max" if limit == "max" else "sys/fs/cgroup/memory/memory.limit_in_bytes"
    usage = name.replace("memory.max", "memory.current").replace("limit_in_bytes", "usage_in_bytes")
    root = _root(tmp_path, {"proc/meminfo": MEMINFO, name: limit, usage: str(GIB)})
    assert available_bytes(root) == 20 * GIB


def test_nothing_known(tmp_path: Path) -> None:
    assert available_bytes(tmp_path) is None


def test_this_machine_reports_something() -> None:
    assert (available_bytes() or 0) > 0


def test_a_cpu_cache_larger_than_the_memory_left_is_refused() -> None:
    sizing = CacheSizing(num_gpu_blocks=1000, num_cpu_blocks=500)  # 1 MiB blocks: 0.98 + 0.49 GiB
    check_host_memory(sizing, 1 << 20, cache_on_host=True, available=2 * GIB)
    check_host_memory(sizing, 1 << 20, cache_on_host=True, available=None)
    with pytest.raises(CacheSizeError) as info:
        check_host_memory(sizing, 1 << 20, cache_on_host=True, available=GIB)
    assert str(info.value) == (
        "the KV cache needs 1.46 GiB of host memory (the cache 0.98 GiB and the swap space 0.49 GiB) but only 1.00 GiB "
        "is available with the model loaded (the machine's, or its container's limit): lower --kv-cache-memory or "
        "--swap-space")


def test_a_gpu_worker_counts_only_its_swap_space() -> None:
    sizing = CacheSizing(num_gpu_blocks=100_000, num_cpu_blocks=2048)
    check_host_memory(sizing, 1 << 20, cache_on_host=False, available=3 * GIB)
    with pytest.raises(CacheSizeError, match=r"needs 2.00 GiB of host memory \(the swap space 2.00 GiB\) .* lower "
                                             r"--swap-space$"):
        check_host_memory(sizing, 1 << 20, cache_on_host=False, available=GIB)


def test_tensor_parallel_ranks_on_one_host_count_each_others_caches() -> None:
    # Each rank's pages are reserved, not backed: the memory left does not show the other ranks' caches.
    sizing = CacheSizing(num_gpu_blocks=1024, num_cpu_blocks=0)  # 1 MiB blocks: 1 GiB a rank
    check_host_memory(sizing, 1 << 20, cache_on_host=True, available=3 * GIB, ranks=2)
    with pytest.raises(CacheSizeError) as info:
        check_host_memory(sizing, 1 << 20, cache_on_host=True, available=3 * GIB, ranks=4)
    assert str(info.value).startswith(
        "the KV cache needs 4.00 GiB of host memory (the cache 1.00 GiB on each of 4 tensor-parallel ranks) but only "
        "3.00 GiB is available")
