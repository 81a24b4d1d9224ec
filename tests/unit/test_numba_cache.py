"""The kernels' Numba cache is stamped with every Numba source of the project, not only each kernel's own file."""

from __future__ import annotations

from pathlib import Path

from llmserve.kernels import numba_cache
from llmserve.kernels.cpu._numba_decode import decode_attention
from worker_service.models._numba_decode_step import decode_layers


def test_the_sources_are_this_package_and_worker_service() -> None:
    kernels_dir, workers_dir = numba_cache._SOURCE_DIRS
    assert (kernels_dir / "cpu" / "_numba_decode.py").is_file()
    assert (workers_dir / "models" / "_numba_decode_step.py").is_file()


def test_the_kernels_cache_through_the_versioned_locator() -> None:
    for kernel in (decode_attention, decode_layers):
        locator = kernel._cache._impl._locator
        assert isinstance(locator, numba_cache._VersionedMixin)
        own_file, digest = locator.get_source_stamp()
        assert digest == numba_cache.sources_digest()
        assert own_file  # Numba's own stamp of the kernel's file is kept


def _tree(root: Path, kernel: str, helper: str, other: str) -> None:
    (root / "kernels" / "cpu").mkdir(parents=True, exist_ok=True)
    (root / "worker_service").mkdir(exist_ok=True)
    (root / "kernels" / "cpu" / "kernel.py").write_text(kernel)
    (root / "worker_service" / "helper.py").write_text(helper)
    (root / "worker_service" / "plain.py").write_text(other)


def test_the_digest_follows_every_numba_source_and_nothing_else(tmp_path: Path) -> None:
    kernel, helper = "import numba\n@numba.njit\ndef f(x): return g(x)\n", "from numba import njit\ndef g(x): return x\n"
    _tree(tmp_path, kernel, helper, "import torch\n")
    dirs = (tmp_path / "kernels", tmp_path / "worker_service")
    before = numba_cache.sources_digest.__wrapped__(dirs)
    _tree(tmp_path, kernel, helper, "import torch\nX = 1\n")  # a file without numba: no change
    assert numba_cache.sources_digest.__wrapped__(dirs) == before
    _tree(tmp_path, kernel, helper.replace("return x", "return x + 1"), "import torch\nX = 1\n")  # a helper
    changed = numba_cache.sources_digest.__wrapped__(dirs)
    assert changed != before
    _tree(tmp_path, kernel, helper, "import torch\nX = 1\n")  # back as it was
    assert numba_cache.sources_digest.__wrapped__(dirs) == before
