"""On a CPU, torch's intra-op threads go to the linear layers and attention; the small ops between run on one.

The worker's OpenMP threads sleep when idle (shared.omp.prefer_sleeping_threads: it shares its
cores), so every parallel region pays for waking them. A matmul earns that back many times over;
the elementwise ops of a decode step do not: at 64 sequences an RMSNorm ([64, 576] floats) took
27 us on one thread and 340-370 us on two, and a decode step of the default model spent ~45 ms of
its ~230 in such ops (multiplies, adds, powers, sums, SiLU averaging 50-160 us each). Within a
forward pass this runs everything on one thread except the nn.Linear modules and the attention
kernels (`full()`, entered by the attention function), which get the configured count back for
their call (torch.set_num_threads costs ~0.1 us). The Numba decode kernel sizes its OpenMP team
by torch's count (kernels.cpu.numba_attention.kernel_threads), so it needs the count back too.

Only steps of up to ONE_THREAD_MAX_TOKENS tokens: larger elementwise ops earn their wake-up. On 2
cores, one thread against two for an RMSNorm / SiLU-and-multiply / rotary embedding: 261 / 700 /
586 us against 525 / 591 / 1346 us at 512 tokens; 657 / 1533 / 1332 against 713 / 949 / 1671 at
1024; two threads ahead on all three from 2048.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

ONE_THREAD_MAX_TOKENS = 512


class MatmulThreads:
    """Forward hooks on a module's linear layers and a `full()` context, active inside `forward()` only."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._threads = 1
        self._active = False
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(self._enter_linear)
                module.register_forward_hook(self._leave_linear)

    def _enter_linear(self, module: torch.nn.Module, args: object) -> None:
        self.__enter__()

    def _leave_linear(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.__exit__()

    def full(self) -> MatmulThreads:
        """A context giving the calling code every configured thread (a no-op outside `forward()`)."""
        return self

    def __enter__(self) -> None:
        if self._active:
            torch.set_num_threads(self._threads)

    def __exit__(self, *exc: object) -> None:
        if self._active:
            torch.set_num_threads(1)

    @contextlib.contextmanager
    def forward(self, num_tokens: int) -> Iterator[None]:
        """One forward pass of num_tokens tokens: one thread outside the linear layers and attention,
        the calling thread's count inside (all of it throughout above ONE_THREAD_MAX_TOKENS).

        The count is the calling thread's (torch keeps one per thread), restored on the way out,
        whatever happens in between.
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
