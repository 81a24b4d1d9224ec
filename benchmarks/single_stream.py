"""Single-stream speed: one request at a time, every backend on the same prompts, 128 output tokens each.

Time per output token (TPOT) excludes the first token, which carries the prompt's prefill; a decode
step of one sequence reads every weight once, so on a CPU this is the memory-bandwidth-bound case
where batching cannot help. Servers are driven by their own clients (benchmarks.llmserve_driver,
benchmarks.openai_driver) with at most one request in flight; transformers' `model.generate` runs
in this process, greedy, its tokens timestamped by a streamer as they come out of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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


class HFGenerate:
    """transformers' `model.generate` in this process, greedy, batch 1 (no padding), one request per call."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32) -> None:
        self.model = _load(model_dir, "sdpa", dtype)
        warm = warm_up_request(self.model.config.vocab_size)
        with torch.inference_mode():
            self.model.generate(torch.tensor([warm.prompt_token_ids]),
                                generation_config=_greedy_config(warm.output_len, 0))

    def __call__(self, req: BenchRequest) -> RequestTiming:
        streamer = TimestampStreamer()
        timing = RequestTiming(prompt_len=len(req.prompt_token_ids), sent=time.perf_counter())
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([req.prompt_token_ids]), streamer=streamer,
                                      generation_config=_greedy_config(req.output_len, 0))
        timing.done = time.perf_counter()
        timing.token_times = streamer.token_times
        generated = out.shape[1] - len(req.prompt_token_ids)
        if generated != req.output_len or len(timing.token_times) != generated:
            timing.error = f"generated {generated} tokens ({len(timing.token_times)} streamed), {req.output_len} asked"
        return timing


# One request through one backend, with at most that request in flight.
Backend = Callable[[BenchRequest], RequestTiming]


def interleaved(backends: dict[str, Backend], requests: list[BenchRequest]) -> dict[str, list[RequestTiming]]:
    """Every request through every backend, backend after backend, the order rotated each round.

    A single-stream token reads every weight once, so its time follows the memory bandwidth, and on the
    2-core VMs of docs/benchmarks-history.md that moves between ~35 and ~60 GB/s over minutes. Backends whose
    requests ran in blocks of their own, minutes apart, were then compared across two speeds of the machine;
    taken in turns, each round's requests see the same machine.
    """
    timings: dict[str, list[RequestTiming]] = {name: [] for name in backends}
    names = list(backends)
    for round_index, req in enumerate(tqdm(requests, desc="single stream, all backends in turn", unit="round")):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timings[name].append(backends[name](req))
    return timings
