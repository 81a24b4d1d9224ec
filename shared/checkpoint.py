"""Where a checkpoint is: a Hugging Face directory, or a single GGUF file that transformers reads."""

from __future__ import annotations

from pathlib import Path


def require_local(path: str, what: str) -> None:
    """ValueError unless `path` is a directory or a `.gguf` file: nothing is downloaded at run time, and transformers
    would take any other string for a Hub repository id (and fail on its syntax, or offline)."""
    is_gguf = path.lower().endswith(".gguf") and Path(path).is_file()
    if not (Path(path).is_dir() or is_gguf):
        raise ValueError(f"{what} must be a local checkpoint directory or .gguf file, got {path!r} (neither exists).")


def pretrained_source(path: str) -> tuple[str, dict[str, str]]:
    """(path for from_pretrained, extra from_pretrained kwargs) for a checkpoint directory or a `.gguf` file.

    transformers reads a GGUF file as `from_pretrained(its_directory, gguf_file=its_name)`, dequantizing
    the weights; tokenizer and config come from the same file.
    """
    file = Path(path)
    if file.suffix.lower() != ".gguf":
        return path, {}
    if not file.is_file():
        raise FileNotFoundError(f"GGUF checkpoint {path} does not exist")
    return str(file.parent), {"gguf_file": file.name}
