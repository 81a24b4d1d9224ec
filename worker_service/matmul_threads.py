"""On a CPU, torch's intra-op threads go to the linear layers and attention; the small ops between run on one.

The worker's OpenMP threads sleep when idle after a short spin (shared/omp.py: it shares its
cores), so a parallel region after a longer gap pays for waking them. A matmul earns that back many times over;
the elementwise ops of a decode step do not: at 64 sequences an RMSNorm ([64, 576] floats) took
27 us on one thread and 340-370 us on two, and a decode step of the default model spent ~45 ms of
its ~230 in such ops (multiplies, adds, powers, sums, SiLU averaging 50-160 us each). Within a
forward pass this runs everything on one thread except the matmul layers (MATMUL_MODULES) and the attention
kernels (`full()`, entered by the attention function), which get the configured count back for
their call (torch.set_num_threads costs ~0.1 us). The Numba decode kernel sizes its OpenMP team
by torch's count (llmserve.kernels.cpu.numba_attention.kernel_threads), so it needs the count back too.

Only steps of up to ONE_THREAD_MAX_TOKENS tokens: larger elementwise ops earn their wake-up. On 2
cores, one thread against two for an RMSNorm / SiLU-and-multiply / rotary embedding: 261 / 700 /
586 us against 525 / 591 / 1346 us at 512 tokens; 657 / 1533 / 1332 against 713 / 949 / 1671 at
1024; two threads ahead on all three from 2048.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.pytorch_utils import Conv1D

from worker_service.sharding import RowParallelLinear

ONE_THREAD_MAX_TOKENS = 512
# The modules whose forward is a matmul: nn.Linear, GPT-2's Conv1D (not an nn.Linear) and the
# tensor-parallel row-parallel linear layer.
MATMUL_MODULES = (torch.nn.Linear, Conv1D, RowParallelLinear)


class MatmulThreads:
    """Forward hooks on a module's matmul layers and a `full()` context, active inside `forward()` only.

    One instance serves one model, whose forward passes never overlap (the servicer runs one step
    at a time): the state below is the running pass's.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._threads = 1
        self._active = False
        for module in model.modules():
            if isinstance(module, MATMUL_MODULES):
                # The hooks' arguments (module, inputs[, output]) are ignored; both return None, so they
                # change neither the inputs nor the output.
                module.register_forward_pre_hook(self.__enter__)
                module.register_forward_hook(self.__exit__)

    def full(self) -> MatmulThreads:
        """A context giving the calling code every configured thread (a no-op outside `forward()`)."""
        return self

    def __enter__(self, *hook_args: object) -> None:
        if self._active:
            torch.set_num_threads(self._threads)

    def __exit__(self, *exc: object) -> None:
        if self._active:
            torch.set_num_threads(1)

    @contextlib.contextmanager
    def forward(self, num_tokens: int) -> Iterator[None]:
        """One forward pass of num_tokens tokens: one thread outside the linear layers and attention,
        the calling thread's count inside (all of it throughout above ONE_THREAD_MAX_TOKENS).

        The count read and restored is the calling thread's (torch.set_num_threads also sets the
        default a thread started later begins with; it is restored on the way out, whatever happens).
        """
        threads = torch.get_num_threads()
        if threads == 1 or num_tokens > ONE_THREAD_MAX_TOKENS:
            yield
            return
        self._threads, self._active = threads, True
        torch.set_num_threads(1)
        try:
            yield
        finally:
            self._active = False
            torch.set_num_threads(threads)
