"""Structured outputs: the request's constraint, its compiled grammar, and the worker's token masks."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.sampling_params import SamplingParams
from shared.sampling_proto import sampling_from_proto, sampling_to_proto
from shared.structured_outputs import StructuredOutputsParams, compile_grammar
from worker_service.grammar_masks import GrammarMasks
from worker_service.token_bitmask import apply_token_bitmask

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("kwargs", [{}, {"regex": "a", "choice": ["a"]}, {"json": "{}", "json_object": True}])
def test_exactly_one_kind(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar"):
        StructuredOutputsParams(**kwargs)


def test_choice_needs_a_string_and_beam_search_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one string"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="not supported with beam search"):
        SamplingParams(temperature=0.0, use_beam_search=True, best_of=2,
                       structured_outputs=StructuredOutputsParams(regex="a"))


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True, compiled="g"),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex="[0-9]+"),
        StructuredOutputsParams(choice=["yes", "no", ""]),
        StructuredOutputsParams(grammar='start: "x"'),
    ],
)
def test_proto_round_trip(params: StructuredOutputsParams) -> None:
    sampling = SamplingParams(structured_outputs=params)
    assert sampling_from_proto(sampling_to_proto(sampling)) == sampling


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(regex="a(b"), "(?s)structured_outputs.regex is not valid: .*unclosed group"),
        (StructuredOutputsParams(json='{"type": "foo"}'), "structured_outputs.json is not valid: Invalid type: foo"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json is not a valid JSON schema: key must be"),
        (StructuredOutputsParams(grammar="start: foo"), "(?s)structured_outputs.grammar is not valid: .*unknown name"),
    ],
)
def test_invalid_constraints_are_refused_with_the_libraries_message(params: StructuredOutputsParams,
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compile_grammar(params)


# --- applying masks ---------------------------------------------------------------------------------------------

def _reference_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 70, 101])
def test_bitmask_application_matches_a_per_token_reference(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1  # a word of 32 allowed tokens (the skipped case)
    bitmask[1, -1] = 0
    rows = [4, 0, 2]
    logits[0, :] = float("-inf")  # row 0 loses every token (its last allowed one is -inf already)
    logits[2, :32] = float("-inf")
    bitmask[2] = 0
    bitmask[2, 0] = -1  # row 2 allows only tokens that are -inf already
    expected = _reference_mask(logits, rows, bitmask)
    numba_path = logits.clone()
    left_numba = apply_token_bitmask(numba_path, rows, bitmask)
    torch_path = logits.t().contiguous().t()  # not contiguous: the tensor-op path
    left_torch = apply_token_bitmask(torch_path, rows, bitmask)
    assert torch.equal(numba_path, expected) and torch.equal(torch_path, expected)
    assert left_numba == left_torch == [True, False, False]


# --- the worker's matchers ---------------------------------------------------------------------------------------

@dataclass
class _Seq:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    grammar: Any = None
    extra: dict = field(default_factory=dict)


def _constrained(params: StructuredOutputsParams, **sampling: Any) -> SamplingParams:
    params.compiled = compile_grammar(params)
    return SamplingParams(structured_outputs=params, **sampling)


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1]


@pytest.fixture(scope="module")
def masks(default_model_dir: Path) -> GrammarMasks:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(default_model_dir).vocab_size
    return GrammarMasks(str(default_model_dir), vocab, eos_token_ids=[2])


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def test_masks_follow_the_grammar_and_end_on_eos(masks: GrammarMasks, tokenizer: Any) -> None:
    sampling = _constrained(StructuredOutputsParams(choice=["yes", "no"]))
    seq = _Seq(1, [5, 6], 2, sampling)
    free = _Seq(2, [5, 6], 2, SamplingParams())
    out = masks.masks([free, seq])
    assert out is not None and out.rows == [1]
    allowed = _allowed(out.bitmask, 0, masks._vocab_size)
    yes, no = (tokenizer(w, add_special_tokens=False).input_ids for w in ("yes", "no"))
    assert yes[0] in allowed and no[0] in allowed and 2 not in allowed
    seq.token_ids += yes
    out = masks.masks([seq])
    assert _allowed(out.bitmask, 0, masks._vocab_size) == [2]  # complete: only EOS
    assert masks.masks([free]) is None


def test_matcher_state_is_a_function_of_the_tokens(masks: GrammarMasks, tokenizer: Any) -> None:
    """Stepping a sequence token by token and learning it afresh at any point (recompute, takeover) give the
    same mask."""
    sampling = _constrained(StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    text = tokenizer('{"ok": true, "n": 42}', add_special_tokens=False).input_ids
    stepped = _Seq(1, [7, 8, 9], 3, sampling)
    for position in range(len(text) + 1):
        incremental = masks.masks([stepped]).bitmask
        fresh = masks.masks([_Seq(1, list(stepped.token_ids), 3, sampling)]).bitmask
        assert torch.equal(incremental, fresh), position
        if position < len(text):
            assert text[position] in _allowed(incremental, 0, masks._vocab_size)
            stepped.token_ids.append(text[position])
    assert _allowed(masks.masks([stepped]).bitmask, 0, masks._vocab_size) == [2]


def test_a_refused_token_leaves_only_eos(masks: GrammarMasks, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    sampling = _constrained(StructuredOutputsParams(regex="[0-9]+"))
    letter = tokenizer("x", add_special_tokens=False).input_ids
    seq = _Seq(3, [1] + letter, 1, sampling)
    with caplog.at_level(logging.ERROR):
        out = masks.masks([seq])
    assert _allowed(out.bitmask, 0, masks._vocab_size) == [2]
    assert "sequence 3: its grammar refused token" in caplog.text


def test_a_grammar_the_worker_cannot_use_ends_the_sequence_instead_of_the_step(
        default_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A compiled text that does not compile, or a tokenizer the worker cannot load: EOS only, and a log line."""
    sampling = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", compiled="start: nope"))
    broken = GrammarMasks(str(default_model_dir / "missing"), 49152, eos_token_ids=[2, 63])
    working = GrammarMasks(str(default_model_dir), 49152, eos_token_ids=[2])
    with caplog.at_level(logging.ERROR):
        no_tokenizer = broken.masks([_Seq(1, [5], 1, _constrained(StructuredOutputsParams(regex="a")))])
        bad_grammar = working.masks([_Seq(2, [5], 1, sampling)])
    assert _allowed(no_tokenizer.bitmask, 0, 49152) == [2, 63]  # 63: bit 31, the sign bit
    assert _allowed(bad_grammar.bitmask, 0, 49152) == [2]
    assert "sequence 1: no grammar matcher could be made" in caplog.text
    assert "sequence 2: its grammar does not compile" in caplog.text
