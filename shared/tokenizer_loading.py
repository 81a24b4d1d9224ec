"""A checkpoint's tokenizer, as ``AutoTokenizer`` loads it, without importing torch where that is safe.

``AutoTokenizer.from_pretrained`` decides the tokenizer class from the model's config, and building
that config imports torch: 3-5 s and ~300 MB of a scheduler replica or the HTTP front, neither of
which runs a model. Most checkpoints of the families llmserve serves name ``TokenizersBackend`` (a
plain ``tokenizer.json``) in their ``tokenizer_config.json``, and for their model types AutoTokenizer
then returns exactly that class (tests/unit/test_tokenizer_loading.py checks the types below against
transformers' own tables and compares both loaders' tokenizers). Those load directly; anything else
(other model types, remote code, a GGUF file, a missing or unusual file) goes through AutoTokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from shared.checkpoint import pretrained_source, require_local

log = logging.getLogger(__name__)

# Model types for which AutoTokenizer keeps a hub-declared TokenizersBackend: not in transformers'
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (qwen2 is: it gets Qwen2Tokenizer) and not mapped to
# MistralCommonBackend.
DIRECT_MODEL_TYPES = frozenset({"llama", "mistral", "opt", "gpt2"})
DIRECT_CLASS = "TokenizersBackend"


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def loads_directly(directory: Path) -> bool:
    """Whether AutoTokenizer would build this checkpoint's tokenizer as a plain TokenizersBackend."""
    tokenizer_config = _json(directory / "tokenizer_config.json")
    config = _json(directory / "config.json")
    if tokenizer_config is None or config is None or not (directory / "tokenizer.json").is_file():
        return False
    return (
        tokenizer_config.get("tokenizer_class") == DIRECT_CLASS
        and "auto_map" not in tokenizer_config  # remote code decides
        and "auto_map" not in config
        and config.get("model_type") in DIRECT_MODEL_TYPES
        and "model_name" not in config  # AutoTokenizer also matches its exceptions on this name
    )


# A tokenizer's own files in a checkpoint directory (a fast tokenizer's, SentencePiece's, a BPE vocabulary's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a checkpoint directory or GGUF file (what AutoTokenizer.from_pretrained returns).

    ValueError, naming the path, for anything else or a directory without a tokenizer: transformers' own errors
    there speak of Hub repository ids or of slow-tokenizer conversions.
    """
    require_local(path, "tokenizer")
    source, kwargs = pretrained_source(path)
    if not kwargs and loads_directly(Path(source)):
        from transformers import TokenizersBackend  # noqa: PLC0415 - imports no torch

        return TokenizersBackend.from_pretrained(source)
    if not kwargs and not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): give the directory the "
                         "checkpoint was saved to with its tokenizer (save_pretrained of both), or a .gguf file")
    from transformers import AutoTokenizer  # noqa: PLC0415 - imports torch

    log.debug("tokenizer of %s through AutoTokenizer", path)
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"the tokenizer in {path} could not be loaded: {exc}") from exc
