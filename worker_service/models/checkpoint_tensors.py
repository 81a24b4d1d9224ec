"""A checkpoint's tensors by their Hugging Face names, read as the fused model needs them.

A directory of safetensors files is read directly (memory-mapped, one tensor at a
time): no transformers model is built, which keeps a worker's start-up to the
bytes it reads. Anything else transformers can load (a GGUF file, which it
dequantizes; PyTorch ``.bin`` weights) goes through ``from_pretrained`` once and is
read from the loaded model's state dict, under the same names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from shared.checkpoint import pretrained_source

_INDEX = "model.safetensors.index.json"


class CheckpointTensors:
    """``get(name)``: one tensor of the checkpoint, in ``dtype`` on ``device``, or None if absent."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self._handles: dict[str, object] = {}  # tensor name -> its open safetensors file
        self._state: dict[str, torch.Tensor] | None = None
        directory = Path(path)
        files = _safetensors_files(directory) if directory.is_dir() else []
        if files:
            for file in files:
                handle = safe_open(str(file), framework="pt")
                self._handles.update(dict.fromkeys(handle.keys(), handle))
        else:
            from transformers import AutoModelForCausalLM  # noqa: PLC0415 - model code, only on this path

            source, kwargs = pretrained_source(path)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
            self._state = dict(model.state_dict())

    def get(self, name: str) -> torch.Tensor | None:
        if self._state is not None:
            tensor = self._state.get(name)
        elif name in self._handles:
            tensor = self._handles[name].get_tensor(name)  # type: ignore[attr-defined]
        else:
            tensor = None
        return None if tensor is None else tensor.to(device=self.device, dtype=self.dtype)

    def require(self, name: str) -> torch.Tensor:
        tensor = self.get(name)
        if tensor is None:
            raise ValueError(f"checkpoint has no tensor {name!r}")
        return tensor


def _safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors shards: those its index names, else every ``*.safetensors`` file."""
    index = directory / _INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    return sorted(directory.glob("*.safetensors"))
