"""Per-step cost of structured outputs on the worker: 64 sequences constrained by JSON schemas.

    python -m benchmarks.structured_outputs [--seqs 64] [--steps 200] [--output benchmarks/results/structured_outputs.json]

Each step does what the worker's sampling does for the batch, on logits of the default model's vocabulary
([seqs, 49152] float32; random, so each sequence walks its own path through its grammar): the grammar masks
(GrammarMasks.masks: each matcher consumes the last token, then llguidance fills the masks on its threads)
and their application to the logits (sampler.apply_grammar: a copy of the logits, then the Numba loop),
each timed apart; then `sample()` with the masks picks the tokens. The baseline is `sample()` of the same
logits without masks, timed in the same step: what the step costs without structured outputs (its spread,
dominated by the seeded rows' noise, is larger than the masking's cost, which is why the two parts are
timed apart and not as a difference of two samples). Half the rows are greedy, half sample at temperature
0.8 with a seed. A sequence whose grammar ends (EOS) is replaced by a new one, which builds its matcher, so
the batch stays full; the first step (64 matchers built at once) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from benchmarks.json_schemas import SCHEMAS
from benchmarks.run_info import run_info
from shared.default_model import prepare_default_model
from shared.sampling_params import SamplingParams
from shared.structured_outputs import StructuredOutputsParams, compile_grammar
from worker_service.grammar_masks import GrammarMasks
from worker_service.model_runner import eos_token_ids
from worker_service.sampler import apply_grammar, sample

RESULTS = Path("benchmarks/results/structured_outputs.json")
PROMPT = [1, 2, 3, 4]


@dataclass
class _Seq:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    grammar: Any = None


def _params(index: int) -> SamplingParams:
    schema = SCHEMAS[index % len(SCHEMAS)][1]
    structured = StructuredOutputsParams(json=json.dumps(schema))
    structured.compiled = compile_grammar(structured)
    sampling = {"temperature": 0.0} if index % 2 == 0 else {"temperature": 0.8, "seed": index}
    return SamplingParams(max_tokens=1024, structured_outputs=structured, **sampling)


def run(num_seqs: int, steps: int) -> dict[str, Any]:
    model = prepare_default_model()
    config = AutoConfig.from_pretrained(model)
    eos = eos_token_ids(config, str(model))
    grammars = GrammarMasks(str(model), config.vocab_size, eos)
    params = [_params(i) for i in range(num_seqs)]
    seqs = [_Seq(i, list(PROMPT), len(PROMPT), params[i]) for i in range(num_seqs)]
    next_id = num_seqs
    generator = torch.Generator().manual_seed(0)
    mask_ms: list[float] = []
    apply_ms: list[float] = []
    baseline_ms: list[float] = []
    first_step_mask_ms = 0.0
    finished = 0
    for step in range(steps + 1):
        logits = torch.randn(num_seqs, config.vocab_size, generator=generator)
        t0 = time.perf_counter()
        masks = grammars.masks(seqs)
        t1 = time.perf_counter()
        assert masks is not None
        apply_grammar(logits, logits, masks)
        t2 = time.perf_counter()
        sample(logits, params, seqs, eos)
        t3 = time.perf_counter()
        out = sample(logits, params, seqs, eos, masks)
        if step == 0:
            # Builds the tokenizer (once per worker) and 64 matchers: reported apart from the steady steps.
            first_step_mask_ms = (t1 - t0) * 1e3
        else:
            mask_ms.append((t1 - t0) * 1e3)
            apply_ms.append((t2 - t1) * 1e3)
            baseline_ms.append((t3 - t2) * 1e3)
        for i, token in enumerate(out.token_ids):
            if token in eos:
                finished += 1
                seqs[i] = _Seq(next_id, list(PROMPT), len(PROMPT), params[i])
                next_id += 1
            else:
                seqs[i].token_ids.append(token)
    median = statistics.median
    return {
        **run_info(),
        "seqs": num_seqs, "steps": steps, "vocab_size": config.vocab_size, "documents_completed": finished,
        "first_step_masks_ms": first_step_mask_ms,
        "masks_ms": median(mask_ms),
        "apply_ms": median(apply_ms),
        "added_ms": median(m + a for m, a in zip(mask_ms, apply_ms)),
        "sample_without_masks_ms": median(baseline_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args.seqs, args.steps)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.seqs} constrained sequences, median of {args.steps} steps: masks {result['masks_ms']:.2f} ms, "
          f"applied {result['apply_ms']:.2f} ms, added per step {result['added_ms']:.2f} ms (sample() without them "
          f"{result['sample_without_masks_ms']:.1f} ms); first step's masks {result['first_step_masks_ms']:.0f} ms; "
          f"{result['documents_completed']} documents completed")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
