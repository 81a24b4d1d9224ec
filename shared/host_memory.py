"""How much host memory this process may still take: the kernel's estimate, or less under a container's limit.

A CPU worker allocates its KV cache (and every worker its swap space) in host memory at start-up. Allocated with
``torch.zeros``, the pages are only reserved: a cache larger than the memory left can pass that call, and the worker
is then killed by the OOM killer once requests fill it. So the worker compares the cache's size with this first.
"""

from __future__ import annotations

from pathlib import Path

# cgroup v1 reports "no limit" as a huge page-rounded number rather than a word.
_NO_LIMIT_V1 = 1 << 60


def available_bytes(root: Path = Path("/")) -> int | None:
    """MemAvailable, lowered to what a cgroup's limit leaves of it where that is smaller; None where neither is known
    (not Linux). ``root``: a directory laid out as ``/`` (tests)."""
    found = [value for value in (_meminfo_available(root), _cgroup_room(root)) if value is not None]
    return min(found) if found else None


def _meminfo_available(root: Path) -> int | None:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == "MemAvailable":
                return int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


# Per cgroup version: the limit, the usage, the statistics file and its reclaimable page cache's name.
_CGROUP_FILES = (
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # v2
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
)


def _cgroup_room(root: Path) -> int | None:
    """The limit minus the working set (usage less inactive page cache, which the kernel reclaims before it kills:
    the kubelet's measure) of the cgroup this process sees at /sys/fs/cgroup (its own, in a container)."""
    cgroup = root / "sys/fs/cgroup"
    for limit_file, usage_file, stat_file, inactive in _CGROUP_FILES:
        try:
            limit_text = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit_text.isdigit() or int(limit_text) >= _NO_LIMIT_V1:  # v2 says "max"
            return None
        return max(0, int(limit_text) - usage + _stat(cgroup / stat_file, inactive))
    return None


def _stat(path: Path, name: str) -> int:
    """One counter of a cgroup's memory.stat, 0 where it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
