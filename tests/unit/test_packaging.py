"""The kernels keep their top-level kernels/ directory and import as llmserve.kernels.

Hugging Face's `kernels` package (which transformers looks for by that name) and llmserve's kernels must not
shadow each other: the llmserve distribution declares no top-level `kernels` package, and a process started in
the checkout (whose root is first on sys.path) still gets the installed `kernels` under the bare name.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import llmserve.kernels

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernels_import_from_the_top_level_kernels_directory() -> None:
    assert Path(llmserve.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_the_distribution_declares_no_top_level_kernels_package() -> None:
    top_level = importlib.metadata.distribution("llmserve").read_text("top_level.txt")
    assert top_level is not None
    assert "llmserve" in top_level.split() and "kernels" not in top_level.split()


def _run_in_checkout(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_transformers_model_code_imports_from_the_checkout_root() -> None:
    # transformers' modeling_utils imports Hugging Face's kernels by the bare name when it is installed.
    assert _run_in_checkout("import transformers.modeling_utils; print('imported')") == "imported"


def _hugging_face_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _hugging_face_kernels_installed(), reason="Hugging Face's kernels is not installed")
def test_the_bare_name_is_the_installed_kernels_package_in_the_checkout() -> None:
    installed = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    found = _run_in_checkout("import kernels, llmserve.kernels as ours; print(kernels.__file__, ours.__file__)")
    bare, ours = (Path(p).resolve() for p in found.split())
    assert bare == Path(installed).resolve()
    assert ours == ROOT / "kernels" / "__init__.py"
