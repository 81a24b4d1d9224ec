"""The kernels keep their top-level kernels/ directory and import as llmserve.kernels.

Hugging Face's `kernels` package (which transformers looks for by that name) and llmserve's kernels must not
shadow each other: the llmserve distribution declares no top-level `kernels` package.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import llmserve.kernels

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernels_import_from_the_top_level_kernels_directory() -> None:
    assert Path(llmserve.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_the_distribution_declares_no_top_level_kernels_package() -> None:
    top_level = importlib.metadata.distribution("llmserve").read_text("top_level.txt")
    assert top_level is not None
    assert "llmserve" in top_level.split() and "kernels" not in top_level.split()
