"""Numba-CUDA backend of the paged KV-cache kernels (same API and semantics as :mod:`kernels.cpu`).

Design
------
Attention (:mod:`llmserve.kernels.cuda.attention_kernels`) follows vLLM's paged_attention:

- **Grid** ``(query rows, heads, partitions)``, 128 threads (4 warps) per block.
  A decode row is a sequence; prefill (``context_attention``) makes every query
  token a row whose context ends at its own position, which is the causal mask.
  Rows go on grid x (up to 2^31 - 1; y and z stop at 65535).
- **Thread groups**: warps take KV blocks round-robin; within a warp, a group of
  ``32 // block_size`` lanes scores one token of the block, reading the key's
  16-byte chunks of the ``[.., head_size // x, block_size, x]`` layout together,
  and sums its partial dot products with xor shuffles.
- **Reductions**: max and sum go through warp shuffles, then one float per warp
  in shared memory; the weighted value sum is reduced across warps through
  shared memory (reusing the scores buffer).
- **Partitions** (vLLM v2): long contexts are split into 512-position
  partitions, one thread block each, combined by a reduce kernel. Used when the
  longest context spans more than one partition and either the grid has
  <= 512 blocks (too few to fill the GPU: long contexts, small batches) or the
  context exceeds 8192 positions (scores would not fit shared memory);
  see :func:`llmserve.kernels.cuda.attention.partition_size_for`.
- **dtypes**: fp16 / bf16 / fp32 in, float32 math. bf16 tensors are passed as
  int16 bit patterns and converted in-kernel (``bits << 16``; round to nearest
  even on the way back), see :mod:`llmserve.kernels.cuda._dtypes`. Kernels are
  specialized per (head size, block size, partition size, dtypes) and compiled
  on first use.

Cache ops (:mod:`llmserve.kernels.cuda.cache_ops`) copy raw bits: ``reshape_and_cache``
uses one thread block per token; ``copy_blocks`` one launch over
(pairs x layers' caches) for up to 32 layers.

Swaps (:mod:`llmserve.kernels.cuda.swap`) are DMA copies: ``swap_blocks`` copies runs of
consecutive blocks on the current stream; :class:`LayerSwapper` owns a
dedicated stream and one CUDA event per layer, so the model waits for each
layer's blocks just before that layer reads them.

Tensors and streams (:mod:`llmserve.kernels.cuda._device`): kernels take torch tensors
without copies via ``__cuda_array_interface__`` and launch on torch's current
stream. Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, used by the
tests on machines without a GPU) the same kernels take CPU tensors through
NumPy views, and :mod:`llmserve.kernels.cuda._simulator` supplies the warp shuffles the
simulator lacks.
"""

from llmserve.kernels.cuda.attention import context_attention, paged_attention
from llmserve.kernels.cuda.cache_ops import copy_blocks, reshape_and_cache
from llmserve.kernels.cuda.swap import LayerSwapper, swap_blocks

__all__ = [
    "LayerSwapper",
    "context_attention",
    "copy_blocks",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]
