"""Reductions of a step's metadata tensors, computed once per step instead of once per layer.

A model calls every kernel once per layer with the same step metadata (block
tables, context lengths, slot mapping). The checks that read those tensors
(their minimum / maximum block id, the longest context) reduce them and read
the result back to the host: a synchronization on a GPU, which per layer
would stall the CPU behind every queued kernel of the step. The first call of
a step computes the reduction; later calls with the very same, unmodified
tensors reuse it.

The result is kept on the tensor object itself (so it lives and dies with the
step's metadata, with no cache to bound or clear) together with autograd's
version counter, which every in-place torch op on the tensor or any view of
it bumps. Writes that bypass that counter (through ``.numpy()`` or ``.data``)
are not seen: metadata must be rebuilt, or modified with torch ops, between
kernel calls, as the worker does (it builds fresh tensors every step).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")

_ATTRIBUTE = "_llmserve_reductions"


def arguments_layout(*tensors: torch.Tensor | None) -> tuple[object, ...]:
    """What argument checks see of these tensors (shape, strides, dtype, device): a key under which a
    check's result holds for every call of a step, whichever tensors (layers) are passed."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def reduce_once(owner: torch.Tensor, others: tuple[torch.Tensor, ...], key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, or its earlier result while ``owner`` and ``others`` are the same unmodified tensors.

    key: what else the result depends on (block size, sliding window); each key keeps its own
    result, so layers that alternate settings (Mistral's sliding-window layers) all hit.
    The result must not be mutated by callers: it is shared between calls.
    Inference tensors (made under ``torch.inference_mode``) have no version counter, so a change
    could not be seen: their reductions are computed every time.
    """
    if owner.is_inference() or any(t.is_inference() for t in others):
        return compute()
    versions = (owner._version, *(t._version for t in others))
    memo: dict[Hashable, tuple[tuple[int, ...], tuple[weakref.ref[torch.Tensor], ...], object]] | None
    memo = getattr(owner, _ATTRIBUTE, None)
    if memo is not None and key in memo:
        seen_versions, refs, value = memo[key]
        # Identity by weak reference: an id() could be reused by a new tensor after the old one is freed.
        if seen_versions == versions and all(ref() is t for ref, t in zip(refs, others, strict=True)):
            return value  # type: ignore[return-value]
    value = compute()
    if memo is None:
        memo = {}
        setattr(owner, _ATTRIBUTE, memo)
    memo[key] = (versions, tuple(weakref.ref(t) for t in others), value)
    return value
