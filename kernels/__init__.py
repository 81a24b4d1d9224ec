"""Paged KV-cache kernels (vLLM layout) behind one API shared by all backends.

Pick a backend for the device the caches live on::

    backend = kernels.get_backend(device)
    backend.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    backend.paged_attention(out, query, key_cache, value_cache, ...)

The package-level kernel functions are the CPU versions, for convenience.
The cache layout is described in :mod:`kernels.layout`.

This directory imports as ``llmserve.kernels``. The bare name ``kernels`` belongs to Hugging Face's
``kernels`` package, which transformers (>= 5.25 requires it) imports by that name. A process started
in a checkout has the checkout's root first on ``sys.path`` (``python -m``, pytest), where this
directory would shadow it, so when it is imported by the bare name it hands the name over to the
installed package.
"""

import sys


def _installed_kernels_spec():
    """The spec of a ``kernels`` package found on ``sys.path`` outside this checkout, or None."""
    from importlib.machinery import PathFinder
    from os.path import abspath, dirname

    checkout = dirname(dirname(abspath(__file__)))
    return PathFinder.find_spec("kernels", [p for p in sys.path if abspath(p or ".") != checkout])


if __name__ == "kernels" and (_spec := _installed_kernels_spec()) is not None and _spec.loader is not None:
    from importlib.util import module_from_spec

    _installed = module_from_spec(_spec)
    # The import statement returns what sys.modules holds once this file has run.
    sys.modules["kernels"] = _installed
    _spec.loader.exec_module(_installed)
else:
    from llmserve.kernels.backend import KernelBackend, get_backend
    from llmserve.kernels.cpu import context_attention, copy_blocks, paged_attention, reshape_and_cache, swap_blocks
    from llmserve.kernels.layout import allocate_kv_cache, key_cache_shape, kv_pack_factor, value_cache_shape

__all__ = [
    "KernelBackend",
    "allocate_kv_cache",
    "context_attention",
    "copy_blocks",
    "get_backend",
    "key_cache_shape",
    "kv_pack_factor",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
    "value_cache_shape",
]
