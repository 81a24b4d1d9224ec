"""What a user would run instead: transformers on the same weights and prompts.

- static batching: `generate` over batches of `batch_size` prompts, left-padded,
  each batch generating as many tokens as its longest requested output (the
  extra tokens of shorter requests are discarded and not counted);
- continuous batching: transformers' own paged continuous-batching manager
  (`generate_batch`'s engine), with each request's own `max_new_tokens`, and
  per-token timestamps so TTFT / TPOT are comparable with llmserve's.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig

from benchmarks.dataset import BenchRequest
from benchmarks.metrics import RequestTiming, Summary, summarize


def _load(model_dir: str, attn_implementation: str, dtype: torch.dtype) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    model.eval()
    return model


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[len(prompts), longest]``, each prompt right-aligned after ``pad``s, as
    `generate` takes a batch of a decoder-only model."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _greedy_config(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    # ignore_eos as in llmserve's runs: no EOS, every request generates exactly its length.
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=pad_token_id)


def run_static_batching(model_dir: str, requests: list[BenchRequest], batch_size: int,
                        dtype: torch.dtype = torch.float32) -> Summary:
    """Batches in arrival order; output tokens counted as requested (what llmserve generates for them)."""
    model = _load(model_dir, "sdpa", dtype)
    pad = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in tqdm(range(0, len(requests), batch_size), desc="hf static", unit="batch", leave=False):
            batch = requests[first : first + batch_size]
            ids, mask = left_padded([r.prompt_token_ids for r in batch], pad)
            model.generate(ids, attention_mask=mask,
                           generation_config=_greedy_config(max(r.output_len for r in batch), pad))
    duration = time.perf_counter() - start
    return Summary(
        backend=f"hf static batching (batch {batch_size})", duration_s=duration, completed=len(requests), failed=0,
        input_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=sum(r.output_len for r in requests),
    )


def run_continuous_batching(model_dir: str, requests: list[BenchRequest], dtype: torch.dtype = torch.float32
                            ) -> tuple[Summary, list[RequestTiming]]:
    """transformers' continuous batching, all requests submitted at once (like llmserve's rate=inf run)."""
    model = _load(model_dir, "paged|sdpa", dtype)
    config = _greedy_config(max(r.output_len for r in requests), 0)
    timings: dict[str, RequestTiming] = {}
    # The manager's worker thread writes tensors in place: not under inference_mode (transformers' own rule).
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=60) as manager:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            rid = f"r{i}"
            timings[rid] = RequestTiming(prompt_len=len(r.prompt_token_ids), sent=time.perf_counter())
            manager.add_request(r.prompt_token_ids, request_id=rid, max_new_tokens=r.output_len,
                                record_timestamps=True)
        with tqdm(total=len(requests), desc="hf continuous", unit="req", leave=False) as bar:
            done = 0
            while done < len(requests):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped")
                    continue
                if not result.is_finished():
                    continue
                timing = timings[result.request_id]
                timing.token_times = list(result.timestamps or [])
                timing.done = time.perf_counter()
                timing.error = result.error or ""
                done += 1
                bar.update(1)
        duration = time.perf_counter() - start
    return summarize("hf continuous batching", list(timings.values()), duration), list(timings.values())
