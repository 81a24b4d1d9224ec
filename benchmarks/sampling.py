"""Cost of the worker's sampling per step, against the torch-only way in the same run.

    python -m benchmarks.sampling [--rows 64] [--threads 2] [--output benchmarks/results/sampling.json]

The logits are the default model's own ([rows, 49152] float32, the last `rows` positions of an English
passage), so top-p nuclei have the widths a served model gives. Each parameter set is timed through
`sample()` as the worker runs it, and again with the baselines it replaced: torch's ops for the
exponential race (`exponential_()` noise, a softmax, a division) and a full sort of every row for
top-k / top-p. Rounds alternate the two so that a machine's drift hits both; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from benchmarks.run_info import run_info, write_results
from shared.default_model import prepare_default_model
from shared.sampling_params import SamplingParams
from worker_service import logits_processing, sampler

RESULTS = Path("benchmarks/results/sampling.json")
PASSAGE = (
    "The history of the city begins in the early medieval period, when a small settlement grew up around a river "
    "crossing. Over the following centuries merchants built warehouses along the banks, and the town became known "
    "for its wool trade. In the nineteenth century the railway arrived, bringing factories, new housing and a rapid "
    "growth in population. "
)
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8, seeded": SamplingParams(temperature=0.8, seed=7),
    "temperature 0.8, top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "temperature 1.0, top_p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "temperature 0.8, top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "temperature 0.8, min_p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
}


@dataclass
class History:
    token_ids: list[int]
    num_prompt_tokens: int


def model_logits(rows: int) -> torch.Tensor:
    """The default model's logits at the last `rows` positions of PASSAGE (repeated as needed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - only this benchmark's setup

    path = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer(PASSAGE * (1 + rows // 40), return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0, -rows:].contiguous().float()


@contextmanager
def torch_only() -> Iterator[None]:
    """The sampler as it was: torch's race, and top-k / top-p over whole sorted rows."""
    with mock.patch.object(sampler, "_compiled_race_for", lambda logits: False), \
            mock.patch.object(logits_processing, "_compiled_cut_for", lambda logits: False), \
            mock.patch.object(logits_processing, "CANDIDATE_COUNTS", ()):
        yield


def _median_ms(fn: Callable[[], object], context: Callable[[], AbstractContextManager[object]], repeats: int) -> float:
    with context():
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="sequences sampled per step")
    parser.add_argument("--threads", type=int, default=2, help="torch and Numba threads")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of both ways")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import numba  # noqa: PLC0415 - after torch's thread setting, as the worker does

    numba.set_num_threads(args.threads)
    logits = model_logits(args.rows)
    histories = [History(list(range(100)), 90) for _ in range(args.rows)]
    rows = []
    for name, params in CASES.items():
        batch = [params] * args.rows

        def step(batch: list[SamplingParams] = batch) -> object:
            return sampler.sample(logits, batch, histories)

        now, before = [], []
        for _ in range(args.rounds):
            now.append(_median_ms(step, nullcontext, 5))
            before.append(_median_ms(step, torch_only, 5))
        row = {"case": name, "ms": statistics.median(now), "torch_only_ms": statistics.median(before)}
        rows.append(row)
        print(f"{name:>30}: {row['ms']:7.1f} ms, torch only {row['torch_only_ms']:7.1f} ms")
    result = {
        **run_info(f"torch {torch.__version__}", f"{args.threads} threads"),
        "description": (f"sample() of {args.rows} rows of the default model's logits (49152 tokens) per step, "
                        "as the worker runs it and with torch's ops only (exponential_ noise, full sorts); "
                        f"medians of {args.rounds} alternating rounds of 5 steps."),
        "rows": rows,
    }
    write_results(args.output, result)


if __name__ == "__main__":
    main()
