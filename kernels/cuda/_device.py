"""Handing torch tensors to Numba-CUDA kernels without copies, on the right stream.

This is the only module that knows whether the kernels run on a real GPU or
under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, read by numba itself
when it is first imported):

- real CUDA: tensors live on a CUDA device and are wrapped through
  ``__cuda_array_interface__`` (``numba.cuda.as_cuda_array``); kernels launch on
  torch's current stream, so they are ordered with the surrounding torch ops.
- simulator: tensors live on the CPU and are passed as ``Tensor.numpy()`` views
  wrapped in the simulator's device-array class, so that the simulator neither
  copies them (it would copy a plain NumPy argument in and out, and refuses
  strided ones) nor loses in-place writes.

bfloat16 has no NumPy/Numba type, so bf16 tensors are viewed as int16 and the
kernels convert the bits themselves (see :mod:`llmserve.kernels.cuda._dtypes`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import numba
import torch
from numba import cuda

# Read from numba's configuration, which numba took from the environment when
# it was imported; nothing here reads the environment itself.
SIMULATOR: bool = bool(numba.config.ENABLE_CUDASIM)

# Integer views used to move cache elements as raw bits (copies must be exact,
# NaN payloads included, and need one kernel specialization per element size).
_BITS_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def kernel_device_type() -> str:
    """The torch device type the kernels accept: ``cuda``, or ``cpu`` under the simulator."""
    return "cpu" if SIMULATOR else "cuda"


def check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError unless ``tensor`` is on a device the kernels can run on."""
    expected = kernel_device_type()
    if tensor.device.type != expected:
        where = " (numba's CUDA simulator is enabled)" if SIMULATOR else ""
        raise ValueError(f"{name} is on {tensor.device}; the Numba-CUDA kernels need {expected} tensors{where}")


def kernel_array(tensor: torch.Tensor):  # -> numba DeviceNDArray | numpy.ndarray
    """A zero-copy array view of ``tensor`` for a kernel argument (bf16 viewed as int16)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return _as_array(tensor)


def bits_array(tensor: torch.Tensor):  # -> numba DeviceNDArray | numpy.ndarray
    """A zero-copy view of ``tensor``'s elements as same-sized integers, for exact copies."""
    return _as_array(tensor.view(_BITS_DTYPES[tensor.element_size()]))


# Device-array views for kernel arguments, by everything that defines a view: address, shape, strides,
# element type and device. Wrapping a tensor (`as_cuda_array`: its interface dict, a new array type, the
# CUDA context checks) costs ~20 us on the host, and a kernel call takes up to 11 arguments, while a GPU
# step reuses the same few addresses and shapes (the KV caches of every layer, the caching allocator's
# blocks of the step's inputs). A cached view owns nothing, so the tensors wrapped since the last launch
# are held in `_held` until launch_on has enqueued the next one: a temporary argument
# (`kernel_array(x.to(device))`) freed before that would give its address, and so its view, to the next
# tensor allocated. Once enqueued, the stream orders the kernel before any reuse of the memory.
_views: dict[tuple, object] = {}
_held: list[torch.Tensor] = []
_MAX_VIEWS = 1024
REUSE_VIEWS = True  # benchmarks turn it off to measure what it saves


def _as_array(tensor: torch.Tensor):
    tensor = tensor.detach()
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(tensor.numpy())
    if not REUSE_VIEWS:
        return cuda.as_cuda_array(tensor, sync=False)
    _held.append(tensor)
    key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device.index)
    view = _views.get(key)
    if view is None:
        if len(_views) >= _MAX_VIEWS:
            _views.pop(next(iter(_views)))  # the oldest
        # sync=False: the kernel is launched on torch's current stream (launch_on), which already
        # orders it after whatever produced the tensor. owner=None: the view keeps no tensor alive.
        view = _views[key] = cuda.from_cuda_array_interface(tensor.__cuda_array_interface__, owner=None, sync=False)
    return view


def device_function(func: Callable) -> Callable:
    """``cuda.jit(device=True)``; under the simulator, the plain Python function.

    For helpers that do not use the ``cuda`` module (conversions, shuffles): the
    simulator would swap their module's ``cuda`` global on every call, which is
    slow for per-element helpers and races between its threads.
    """
    return func if SIMULATOR else cuda.jit(device=True)(func)


@contextlib.contextmanager
def launch_on(device: torch.device) -> Iterator[object]:
    """Make ``device`` numba's current GPU and yield the stream to launch on (torch's current one)."""
    if SIMULATOR:
        yield 0  # the simulator runs every launch synchronously
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        with cuda.gpus[index]:
            yield _external_stream(torch.cuda.current_stream(index).cuda_stream)
    finally:
        _held.clear()  # the launches are enqueued on the stream: the arguments' memory is ordered after them


@functools.lru_cache(maxsize=64)
def _external_stream(handle: int):  # -> numba.cuda.cudadrv.driver.Stream
    # Wrapping a stream is cheap but not free; torch reuses a handful of streams.
    return cuda.external_stream(handle)
