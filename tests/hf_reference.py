"""Hugging Face `transformers` reference outputs and the greedy comparison rule.

A greedy divergence is accepted only at a genuine near-tie: the token we
produced and the reference's token are within NEAR_TIE of each other in the
reference's log-probabilities at that position (vLLM's check_logprobs_close
rule). After an accepted divergence the continuations legitimately differ,
so the comparison stops there; the divergence is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from benchmarks.hf_baselines import left_padded

NEAR_TIE = 1e-4
# Half precision against transformers in the same dtype: each side rounds activations to the dtype in
# its own places (transformers after every op; our attention accumulates in float32 over the cache, and
# the compiled decode step's GEMV form keeps float32 activations between the ops; fused and separate projections
# accumulate in different orders), so a logit of magnitude L differs by a few L * eps / 2. The test
# models' logits stay under ~16, and a logprob is a difference of two such numbers: 32 eps covers it
# (bf16: eps 2^-7, tolerance 0.25 nats; measured at most 0.084. fp16: eps 2^-10, 0.031; measured 0.008).
HALF_TOLERANCE = {dtype: 32 * torch.finfo(dtype).eps for dtype in (torch.bfloat16, torch.float16)}


@dataclass
class Reference:
    token_ids: list[int]
    # [num_generated, vocab] log-probabilities the reference saw at each step.
    logprobs: torch.Tensor


class HFReference:
    """Greedy generation with transformers: greedy() one prompt at a time (no padding effects), greedy_many()
    in left-padded batches."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        self.model.eval()
        self.device = torch.device(device)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> Reference:
        """One prompt in its own `generate` call: a batch of one has no padding."""
        return self.greedy_many([prompt_ids], max_new_tokens, stop_at_eos)[0]

    @torch.inference_mode()
    def greedy_many(self, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True,
                    batch_size: int = 16) -> list[Reference]:
        """greedy() of every prompt, ``batch_size`` prompts per `generate` call, left-padded.

        For tests whose many requests made the reference the longest part of the test (one `generate`
        per prompt: 90 ms per token on the default model). Padding changes the reference's logits by
        rounding only (padded keys get no attention weight; the matmuls' shapes differ), so its tokens
        differ from greedy()'s only where two tokens are within rounding of each other, a divergence
        compare_greedy accepts as a near-tie. Tests that compare log-probabilities keep greedy().
        """
        pad = self.model.config.eos_token_id  # `generate`'s pad_token_id (None or a list where the config has it)
        # What fills a short prompt's left: masked out, never attended to.
        fill = (pad[0] if isinstance(pad, list) else pad) or 0
        # The tokens `generate` stops a row at (its generation config's), where it stops at all.
        stops = self.model.generation_config.eos_token_id if stop_at_eos else None
        eos_ids = set(stops) if isinstance(stops, list) else {stops} - {None}
        # Prompts of similar lengths share a batch: less padding to prefill.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        references: dict[int, Reference] = {}
        for first in range(0, len(order), batch_size):
            indices = order[first:first + batch_size]
            ids, mask = left_padded([prompts[i] for i in indices], fill)
            width = ids.shape[1]
            kwargs = {} if stop_at_eos else {"eos_token_id": None}
            out = self.model.generate(
                ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max_new_tokens,
                do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=pad, **kwargs,
            )
            for row in range(len(indices)):
                tokens = out.sequences[row, width:].tolist()
                # A row that stopped is padded while the others go on: keep up to its own stop token.
                end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
                scores = torch.stack([step[row] for step in out.scores[:end]]).float()
                references[indices[row]] = Reference(tokens[:end], torch.log_softmax(scores, dim=-1).cpu())
        return [references[i] for i in range(len(prompts))]


    @torch.inference_mode()
    def beam_search(
        self, prompt_ids: list[int], max_new_tokens: int, num_beams: int, num_return: int,
        eos_token_ids: list[int], length_penalty: float = 1.0, early_stopping: bool | str = False,
    ) -> list[list[int]]:
        """transformers' beam search: the generated tokens of the best `num_return` beams, each cut after its stop token."""
        out = self.model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, num_beams=num_beams, num_return_sequences=num_return,
            length_penalty=length_penalty, early_stopping=early_stopping,
            eos_token_id=eos_token_ids, pad_token_id=eos_token_ids[0],
        )
        beams = []
        for row in out[:, len(prompt_ids):].tolist():
            # Finished beams are padded (with the first stop token): keep up to their own stop token.
            end = next((i + 1 for i, t in enumerate(row) if t in eos_token_ids), len(row))
            beams.append(row[:end])
        return beams


@dataclass
class Comparison:
    matched: bool
    near_tie_at: int | None = None
    detail: str = ""


def compare_greedy(ours: list[int], ref: Reference, near_tie: float = NEAR_TIE) -> Comparison:
    """Token-exact comparison, tolerating a divergence only at a near-tie (``near_tie``: float32's by default)."""
    for i, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if a == b:
            continue
        gap = abs(float(ref.logprobs[i, a] - ref.logprobs[i, b]))
        if gap <= near_tie:
            return Comparison(True, i, f"near-tie at position {i}: {a} vs {b}, logprob gap {gap:.2e}")
        return Comparison(False, None, f"diverged at position {i}: ours {a}, reference {b}, logprob gap {gap:.3g}")
    if len(ours) != len(ref.token_ids):
        return Comparison(False, None, f"lengths differ: ours {len(ours)}, reference {len(ref.token_ids)}")
    return Comparison(True)
