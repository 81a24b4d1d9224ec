"""Single-stream speed: one request at a time, every backend on the same prompts, 128 output tokens each.

Time per output token (TPOT) excludes the first token, which carries the prompt's prefill; a decode
step of one sequence reads every weight once, so on a CPU this is the memory-bandwidth-bound case
where batching cannot help. Servers are driven by their own clients (benchmarks.llmserve_driver,
benchmarks.openai_driver) with at most one request in flight; transformers' `model.generate` runs
in this process, greedy, its tokens timestamped by a streamer as they come out of the loop.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from benchmarks.dataset import BenchRequest, WorkloadSpec, random_requests
from benchmarks.hf_baselines import _greedy_config, _load
from benchmarks.metrics import RequestTiming

OUTPUT_LEN = 128
PROMPT_LEN = 128


def single_stream_requests(vocab_size: int, num_requests: int, seed: int = 0) -> list[BenchRequest]:
    """num_requests prompts of PROMPT_LEN random tokens, each generating OUTPUT_LEN tokens."""
    spec = WorkloadSpec(num_requests, (PROMPT_LEN, PROMPT_LEN), (OUTPUT_LEN, OUTPUT_LEN), seed)
    return random_requests(spec, vocab_size)


def warm_up_request(vocab_size: int) -> BenchRequest:
    """A short request each backend serves first (first-call allocations, caches), not measured."""
    return random_requests(WorkloadSpec(1, (16, 16), (8, 8), seed=12345), vocab_size)[0]


class TimestampStreamer(BaseStreamer):
    """Records when generate() hands out each new token (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.token_times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.token_times.extend([now] * value.numel())

    def end(self) -> None:
        pass


def hf_generate(model_dir: str, requests: list[BenchRequest], dtype: torch.dtype = torch.float32
                ) -> list[RequestTiming]:
    """transformers' `model.generate`, one request at a time (batch 1, no padding), after a warm-up request."""
    model = _load(model_dir, "sdpa", dtype)
    warm = warm_up_request(model.config.vocab_size)
    timings = []
    with torch.inference_mode():
        model.generate(torch.tensor([warm.prompt_token_ids]), generation_config=_greedy_config(warm.output_len, 0))
        for req in tqdm(requests, desc="hf generate, single stream", unit="req", leave=False):
            streamer = TimestampStreamer()
            timing = RequestTiming(prompt_len=len(req.prompt_token_ids), sent=time.perf_counter())
            out = model.generate(torch.tensor([req.prompt_token_ids]), streamer=streamer,
                                 generation_config=_greedy_config(req.output_len, 0))
            timing.done = time.perf_counter()
            timing.token_times = streamer.token_times
            generated = out.shape[1] - len(req.prompt_token_ids)
            if generated != req.output_len or len(timing.token_times) != generated:
                timing.error = f"generated {generated} tokens ({len(timing.token_times)} streamed), " \
                               f"{req.output_len} asked"
            timings.append(timing)
    return timings
