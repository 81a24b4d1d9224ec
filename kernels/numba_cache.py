"""Numba's on-disk cache of the project's kernels, invalidated when any of their sources changes.

Numba stamps a cached function with its own source file only (its documented limit): a kernel
that inlines or calls helpers from other files (every CPU kernel here: the block readers, the
LLVM intrinsics, the float32 exp, the fused ops) would keep loading its old machine code after
those helpers change, until its own file changed too. ``versioned_cache()`` registers cache
locators that add a digest of every Numba source file of the project (kernels/ and
worker_service/, the files that import numba) to the stamp: a change to any of them recompiles
every kernel once, in the same places as before (``__pycache__`` beside each file, or
``NUMBA_CACHE_DIR``).

Each module that defines cached kernels calls ``versioned_cache()`` before its decorators run
(Numba picks a function's locator when it is decorated).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

from numba.core import caching


def _source_dirs() -> tuple[Path, ...]:
    """The folders of the Numba sources: this package's, and worker_service's wherever it is installed (a
    checkout puts both in one tree; an installed wheel puts this one under llmserve/)."""
    spec = importlib.util.find_spec("worker_service")  # located, not imported
    workers = () if spec is None or spec.origin is None else (Path(spec.origin).resolve().parent,)
    return (Path(__file__).resolve().parent, *workers)


_SOURCE_DIRS = _source_dirs()


@functools.cache
def sources_digest(dirs: tuple[Path, ...] = _SOURCE_DIRS) -> bytes:
    """SHA-256 over the paths and contents of every ``*.py`` under ``dirs`` that imports numba."""
    digest = hashlib.sha256()
    for folder in dirs:
        for path in sorted(folder.rglob("*.py")):
            text = path.read_bytes()
            if b"import numba" in text or b"from numba" in text:
                name = f"{folder.name}/{path.relative_to(folder)}"
                digest.update(name.encode() + b"\0" + text + b"\0")
    return digest.digest()


def _is_ours(py_file: str) -> bool:
    return any(Path(py_file).resolve().is_relative_to(folder) for folder in _SOURCE_DIRS)


class _VersionedMixin:
    """A source-file locator whose stamp also covers every Numba source file of the project."""

    @classmethod
    def from_function(cls, py_func: object, py_file: str) -> object:
        return super().from_function(py_func, py_file) if _is_ours(py_file) else None  # type: ignore[misc]

    def get_source_stamp(self) -> object:
        return (super().get_source_stamp(), sources_digest())  # type: ignore[misc]


class _VersionedUserProvided(_VersionedMixin, caching.UserProvidedCacheLocator):
    pass


class _VersionedInTree(_VersionedMixin, caching.InTreeCacheLocator):
    pass


def versioned_cache() -> None:
    """Put the versioned locators first in Numba's list (once per process): NUMBA_CACHE_DIR's, then __pycache__'s."""
    locators = caching.CacheImpl._locator_classes
    if _VersionedInTree not in locators:
        locators[:0] = [_VersionedUserProvided, _VersionedInTree]
