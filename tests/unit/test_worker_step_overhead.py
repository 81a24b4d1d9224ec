"""Host-overhead choices of the worker's step: they must not change any output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numba
import pytest
import torch

from llmserve.kernels.cpu import numba_attention
from shared.sampling_params import SamplingParams
from tests import kernel_cases
from worker_service.sampler import sample


class _History:
    def __init__(self, tokens: list[int]) -> None:
        self.token_ids = tokens
        self.num_prompt_tokens = len(tokens)


def test_greedy_takes_the_first_of_tied_maxima_as_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, float("nan"), 1.0, float("nan")]])
    out = sample(logits, [SamplingParams(temperature=0.0)] * 3, [_History([1])] * 3)
    assert out.token_ids == logits.argmax(dim=-1).tolist() == [1, 0, 1]


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((4, 4, 2, 32, 33), 1),  # the tiny test model's decode step: far too little work for a second thread
        ((1, 9, 3, 64, 4096), 2),  # one long context: enough for both
        ((64, 9, 3, 64, 300), 2),
    ],
)
def test_kernel_threads_grow_with_the_work(shape: tuple[int, int, int, int, int], expected: int) -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert numba_attention.kernel_threads(*shape) == min(expected, numba.config.NUMBA_NUM_THREADS)
        torch.set_num_threads(1)
        assert numba_attention.kernel_threads(*shape) == 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="Numba runs one thread here: nothing to compare")
def test_kernel_output_does_not_depend_on_its_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Work items are independent: one thread and several give the same bits.
    cfg = (torch.float32, 9, 3, 64, 16)
    results: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for minimum in (1, 1 << 40):  # every call on all threads, then every call on one
        monkeypatch.setattr(numba_attention, "_MIN_WORK_PER_THREAD", minimum)
        results.append([])

        def spy(out: torch.Tensor, *args: object, **kwargs: object) -> None:
            numba_attention.paged_attention(out, *args, **kwargs)  # type: ignore[arg-type]
            results[-1].append(out.clone())

        kernel_cases.run_paged(spy, cfg, [1, 17, 40, 300], False, None, 31)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                    reason="Numba's default is one thread here: a reset to it could not be told from --num-threads 1")
def test_the_runner_keeps_the_configured_thread_count(tiny_llama_dir: Path) -> None:
    """--num-threads survives loading the CPU kernels, whose OpenMP runtime resets the thread count.

    In a fresh process: the reset happens only when Numba's runtime first loads.
    """
    script = (
        "import sys, torch\n"
        "from worker_service.config import WorkerConfig\n"
        "from worker_service.model_runner import ModelRunner\n"
        "ModelRunner(WorkerConfig(model=sys.argv[1], num_gpu_blocks_override=8, max_model_len=128, num_threads=1))\n"
        "print(torch.get_num_threads())\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tiny_llama_dir)], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.split()[-1] == "1", done.stdout + done.stderr
