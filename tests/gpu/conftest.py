"""Fixtures of the GPU tests: a tiny random Llama built with the default model's tokenizer.

On a machine that has the default model (`make model`) its tokenizer is used; elsewhere (a GPU machine
that only has this checkout and its Python packages) LLMSERVE_TOKENIZER_DIR names a folder with the
tokenizer's files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = os.environ.get("LLMSERVE_TOKENIZER_DIR")
    if tokenizer is None:
        from shared.default_model import prepare_default_model  # noqa: PLC0415 - converts once, slow

        tokenizer = str(prepare_default_model())
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), Path(tokenizer))
