"""Argument checks only the CUDA backend needs, on top of the shared ones.

The checks both backends run (shapes, metadata, block ids) live in
:mod:`kernels.attention_checks` and :mod:`kernels.cache_op_checks`; these are
the limits of the Numba kernels themselves: their dtypes, their device, and the
block sizes their thread layout supports.
"""

from __future__ import annotations

import torch

from llmserve.kernels.cuda._device import check_kernel_device
from llmserve.kernels.cuda._dtypes import SUPPORTED_DTYPES
from llmserve.kernels.validation import KVCacheDims

_WARP_SIZE = 32


def check_dtypes(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is fp16, bf16 or fp32."""
    for name, tensor in tensors.items():
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {tensor.dtype} is not supported by the CUDA kernels (fp16, bf16, fp32)")


def check_attention_kernel_shape(dims: KVCacheDims) -> None:
    """Raise ValueError for a block size the attention kernels' thread layout cannot handle."""
    # One thread group scores one token of a block; the groups of a warp cover
    # a whole block, so the block size must divide the warp size.
    if _WARP_SIZE % dims.block_size != 0:
        raise ValueError(f"block_size must divide {_WARP_SIZE} for the CUDA attention kernels, got {dims.block_size}")


def check_on_kernel_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is on a device the kernels run on."""
    for name, tensor in tensors.items():
        check_kernel_device(name, tensor)
