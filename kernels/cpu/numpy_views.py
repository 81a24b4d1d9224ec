"""NumPy views of long-lived tensors (the KV caches), made once per tensor instead of once per kernel call.

Every layer of every step hands its caches to the Numba kernels as NumPy arrays; viewing a tensor
(`.view(dtype)`, `.flatten`, `.numpy()`) costs ~1.5 us, paid twice per layer by both the cache write
and the attention call: at one sequence that was ~15 % of a decode attention call. The view is kept
on the tensor object, with the storage address and shape it was made for, so a tensor whose storage
changed (resized, `set_`) gets a fresh one.
"""

from __future__ import annotations

import numpy as np
import torch

_ATTRIBUTE = "_llmserve_numpy_views"


def numpy_view(tensor: torch.Tensor, dtype: torch.dtype, flatten_from: int | None = None) -> np.ndarray:
    """``tensor.view(dtype)`` (its dims from ``flatten_from`` on flattened into one) as a NumPy array."""
    key = (dtype, flatten_from)
    stamp = (tensor.data_ptr(), tensor.shape)
    views: dict[tuple[torch.dtype, int | None], tuple[tuple[int, torch.Size], np.ndarray]] | None
    views = getattr(tensor, _ATTRIBUTE, None)
    if views is not None:
        cached = views.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    else:
        views = {}
        setattr(tensor, _ATTRIBUTE, views)
    viewed = tensor.view(dtype)
    array = (viewed if flatten_from is None else viewed.flatten(flatten_from)).numpy()
    views[key] = (stamp, array)
    return array
