"""MatmulThreads: one thread between the linear layers of a small step, every thread inside them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from worker_service.matmul_threads import ONE_THREAD_MAX_TOKENS, MatmulThreads


class Probe(torch.nn.Module):
    """Records torch's thread count before, inside and after its linear layer, and inside full()."""

    def __init__(self, threads: MatmulThreads | None = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.seen: dict[str, int] = {}
        self.linear.register_forward_hook(lambda *_: self.seen.setdefault("linear", torch.get_num_threads()))
        self.threads = threads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["before"] = torch.get_num_threads()
        y = self.linear(x)
        self.seen["after"] = torch.get_num_threads()
        if self.threads is not None:
            with self.threads.full():
                self.seen["full"] = torch.get_num_threads()
        return y


@pytest.fixture()
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def make() -> tuple[Probe, MatmulThreads]:
    probe = Probe()
    threads = MatmulThreads(probe)
    probe.threads = threads
    return probe, threads


def test_a_small_step_runs_one_thread_outside_linear_layers_and_kernels(two_threads: None) -> None:
    probe, threads = make()
    with threads.forward(num_tokens=64):
        probe(torch.ones(1, 4))
    # The probe's forward hook runs before MatmulThreads' (registered later) hands back one thread.
    assert probe.seen == {"before": 1, "linear": 2, "after": 1, "full": 2}
    assert torch.get_num_threads() == 2


def test_a_large_step_keeps_every_thread(two_threads: None) -> None:
    probe, threads = make()
    with threads.forward(num_tokens=ONE_THREAD_MAX_TOKENS + 1):
        probe(torch.ones(1, 4))
    assert probe.seen == {"before": 2, "linear": 2, "after": 2, "full": 2}


def test_outside_a_forward_pass_nothing_changes(two_threads: None) -> None:
    probe, _ = make()
    probe(torch.ones(1, 4))
    assert probe.seen == {"before": 2, "linear": 2, "after": 2, "full": 2}


def test_a_failed_forward_pass_restores_the_count(two_threads: None) -> None:
    probe, threads = make()
    with pytest.raises(RuntimeError), threads.forward(num_tokens=8):
        probe(torch.ones(1, 3))  # wrong width: the linear layer raises between its hooks
    assert torch.get_num_threads() == 2
    probe(torch.ones(1, 4))  # and a later call outside forward() is left alone
    assert probe.seen["before"] == 2 and probe.seen["after"] == 2


def test_gpt2_conv1d_layers_get_every_thread(two_threads: None) -> None:
    """GPT-2 multiplies through transformers' Conv1D, which is not an nn.Linear."""
    from transformers.pytorch_utils import Conv1D

    seen: list[int] = []
    model = torch.nn.Sequential(Conv1D(4, 4))
    model[0].register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    threads = MatmulThreads(model)
    with threads.forward(num_tokens=8):
        model(torch.ones(1, 4))
    assert seen == [2]
