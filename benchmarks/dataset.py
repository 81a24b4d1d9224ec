"""A fixed-seed random workload, as vLLM's serving benchmark's `random` dataset.

Every request draws its prompt length and output length uniformly from the
given ranges and random token ids from the vocabulary; outputs are forced to
their length (ignore_eos), so every backend generates exactly the same number
of tokens for the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 64
    input_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (16, 128)
    seed: int = 0

    def describe(self) -> str:
        return (f"{self.num_requests} requests, prompts of {self.input_len[0]}-{self.input_len[1]} tokens, "
                f"{self.output_len[0]}-{self.output_len[1]} output tokens (seed {self.seed})")


def random_requests(spec: WorkloadSpec, vocab_size: int, first_token_id: int = 100) -> list[BenchRequest]:
    """The workload; token ids skip the first ids of the vocabulary (special tokens live there)."""
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(*spec.input_len)
        prompt = [rng.randrange(first_token_id, vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, rng.randint(*spec.output_len)))
    return requests


def shared_prefix_requests(num_requests: int, prefix_len: int, suffix_len: int, output_len: int, vocab_size: int,
                           num_prefixes: int = 4, seed: int = 0) -> list[BenchRequest]:
    """Requests whose prompts start with one of a few long shared prefixes (system prompts, few-shot examples)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        BenchRequest(prefixes[i % num_prefixes] + [rng.randrange(100, vocab_size) for _ in range(suffix_len)],
                     output_len)
        for i in range(num_requests)
    ]
