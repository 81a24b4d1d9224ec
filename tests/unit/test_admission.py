"""Admission: tokenization (text, chat, ids), defaults, and every INVALID_ARGUMENT case."""

from __future__ import annotations

import math
import re
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from llmserve.client import make_request
from protos import common_pb2, generation_pb2
from scheduler_service.admission import Admission, AdmittedPrompt, ModelLimits, to_record
from shared.errors import InvalidRequestError, status_for
from shared.sampling_params import SamplingParams
from shared.sampling_proto import sampling_from_proto

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def admission(tokenizer) -> Admission:
    return Admission(tokenizer, ModelLimits(max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer)))


def rejects(admission: Admission, req: generation_pb2.GenerateRequest, fragment: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=re.escape(fragment)) as info:
        admission.admit(req)
    assert status_for(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


# -- prompts -----------------------------------------------------------------------------


def test_text_prompt_is_tokenized_like_the_tokenizer(admission: Admission, tokenizer) -> None:
    prompt = "The capital of France is"
    got = admission.admit(make_request(prompt, request_id="r1"))
    assert isinstance(got, AdmittedPrompt)
    assert got.request_id == "r1"
    assert got.prompt_token_ids == list(tokenizer(prompt).input_ids)
    assert all(isinstance(t, int) for t in got.prompt_token_ids)


def test_chat_messages_render_with_the_chat_template(admission: Admission, tokenizer) -> None:
    messages = [("system", "Be brief."), ("user", "Hi there"), ("assistant", "Hello!"), ("user", "Name a color.")]
    got = admission.admit(make_request(messages=messages))
    text = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
    )
    expected = list(tokenizer(text, add_special_tokens=False).input_ids)
    assert got.prompt_token_ids == expected
    # The generation prompt is there: the rendered text ends with the assistant header.
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\n")


def test_chat_options_render_as_the_tokenizer_does(admission: Admission, tokenizer) -> None:
    messages = [("user", "Name a color."), ("assistant", "The color is")]
    conv = [{"role": r, "content": c} for r, c in messages]
    for options, kwargs, tail in [
        # vLLM's "assistant prefill": the caller's answer stays open for the model to continue.
        (generation_pb2.ChatOptions(add_generation_prompt=False, continue_final_message=True),
         {"add_generation_prompt": False, "continue_final_message": True}, "The color is"),
        (generation_pb2.ChatOptions(add_generation_prompt=False), {"add_generation_prompt": False},
         "The color is<|im_end|>\n"),
        (generation_pb2.ChatOptions(), {"add_generation_prompt": True}, "<|im_start|>assistant\n"),
    ]:
        req = make_request(messages=messages)
        req.chat_options.CopyFrom(options)
        got = admission.admit(req).prompt_token_ids
        expected = list(tokenizer(tokenizer.apply_chat_template(conv, tokenize=False, **kwargs),
                                  add_special_tokens=False).input_ids)
        assert got == expected, options
        assert tokenizer.decode(got).endswith(tail), (options, tokenizer.decode(got))
        tokenize = generation_pb2.TokenizeRequest(messages=req.messages, chat_options=options)
        assert admission.tokenize(tokenize)[0] == expected, options


def test_chat_options_that_cannot_apply_are_refused(admission: Admission) -> None:
    req = make_request(messages=[("user", "Hi"), ("assistant", "Hello")])
    req.chat_options.continue_final_message = True  # with the generation prompt (unset: on)
    rejects(admission, req, "continue_final_message needs add_generation_prompt false")
    req = make_request("Hi")
    req.chat_options.add_generation_prompt = False
    rejects(admission, req,
            "chat_options (add_generation_prompt, continue_final_message, tools, template_kwargs) apply to messages")


def test_prompt_token_ids_pass_through(admission: Admission, tokenizer) -> None:
    ids = [1, 5, 0, len(tokenizer) - 1, 42]
    got = admission.admit(make_request(prompt_token_ids=ids))
    assert got.prompt_token_ids == ids


def test_empty_request_id_gets_a_unique_generated_one(admission: Admission) -> None:
    ids = {admission.admit(make_request("hello")).request_id for _ in range(20)}
    assert len(ids) == 20
    assert all(i and i.isprintable() and len(i) <= 256 for i in ids)


def test_request_id_at_the_length_limit_is_accepted(admission: Admission) -> None:
    rid = "r" * 256
    assert admission.admit(make_request("hello", request_id=rid)).request_id == rid


# -- sampling defaults ---------------------------------------------------------------------


def test_unset_sampling_fields_take_defaults(admission: Admission) -> None:
    got = admission.admit(make_request("hello"))
    assert got.sampling == SamplingParams()
    assert got.sampling.max_tokens == 16


def test_max_tokens_zero_means_the_room_left(admission: Admission, tokenizer) -> None:
    prompt = "one two three four five"
    prompt_len = len(tokenizer(prompt).input_ids)
    got = admission.admit(make_request(prompt, max_tokens=0))
    assert got.sampling.max_tokens == MAX_MODEL_LEN - prompt_len
    got = admission.admit(make_request(prompt_token_ids=[7] * 63, max_tokens=0))
    assert got.sampling.max_tokens == 1


def test_sampling_fields_are_carried(admission: Admission) -> None:
    got = admission.admit(
        make_request(
            "hello", max_tokens=5, temperature=0.25, top_p=0.5, top_k=-1, seed=123, stop=["\n"],
            stop_token_ids=[2], ignore_eos=True,
        )
    )
    s = got.sampling
    assert (s.max_tokens, s.top_k, s.seed, s.stop, s.stop_token_ids, s.ignore_eos) == (5, 0, 123, ["\n"], [2], True)
    assert s.temperature == pytest.approx(0.25) and s.top_p == pytest.approx(0.5)


def test_to_record_round_trips_the_admitted_prompt(admission: Admission) -> None:
    got = admission.admit(make_request(prompt_token_ids=[3, 4, 5], request_id="rec", max_tokens=0, seed=9))
    rec = to_record(got, [10], "w0", 123.5)
    assert (rec.request_id, list(rec.prompt_token_ids), list(rec.seq_ids), rec.worker_id, rec.arrival_time) == (
        "rec", [3, 4, 5], [10], "w0", 123.5,
    )
    assert sampling_from_proto(rec.sampling) == got.sampling
    assert rec.sampling.max_tokens == MAX_MODEL_LEN - 3


def test_boundaries_that_still_fit(admission: Admission) -> None:
    # 63 prompt tokens leave room for exactly one; 60 + 4 == max_model_len.
    assert admission.admit(make_request(prompt_token_ids=[7] * 63, max_tokens=1)).sampling.max_tokens == 1
    assert admission.admit(make_request(prompt_token_ids=[7] * 60, max_tokens=4)).sampling.max_tokens == 4


# -- errors --------------------------------------------------------------------------------


def test_no_prompt(admission: Admission) -> None:
    rejects(admission, make_request(), "the prompt is empty: set one of prompt, prompt_token_ids or messages")


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"prompt": "hi", "prompt_token_ids": [1]}, "prompt, prompt_token_ids"),
        ({"prompt": "hi", "messages": [("user", "x")]}, "prompt, messages"),
        ({"prompt_token_ids": [1], "messages": [("user", "x")]}, "prompt_token_ids, messages"),
        ({"prompt": "hi", "prompt_token_ids": [1], "messages": [("user", "x")]}, "prompt, prompt_token_ids, messages"),
    ],
)
def test_two_prompt_kinds(admission: Admission, kwargs: dict, names: str) -> None:
    rejects(admission, make_request(**kwargs), f"set exactly one of prompt, prompt_token_ids or messages, got {names}")


def test_ids_outside_the_vocabulary(admission: Admission, tokenizer) -> None:
    vocab = len(tokenizer)
    rejects(
        admission,
        make_request(prompt_token_ids=[1, vocab, 2, vocab + 5]),
        f"prompt_token_ids contains ids outside the vocabulary (size {vocab}): [{vocab}, {vocab + 5}]",
    )


def test_prompt_as_long_as_the_context(admission: Admission) -> None:
    err = rejects(
        admission,
        make_request(prompt_token_ids=[7] * MAX_MODEL_LEN),
        f"the prompt has {MAX_MODEL_LEN} tokens, but this model's maximum context length is {MAX_MODEL_LEN} tokens",
    )
    assert "shorten the prompt" in str(err)
    rejects(admission, make_request(prompt_token_ids=[7] * 100, max_tokens=0), "the prompt has 100 tokens")


def test_prompt_plus_max_tokens_too_long(admission: Admission) -> None:
    rejects(
        admission,
        make_request(prompt_token_ids=[7] * 60, max_tokens=5),
        "this model's maximum context length is 64 tokens, but 65 were requested "
        "(60 in the prompt, 5 for the completion); lower max_tokens or shorten the prompt",
    )


def test_bad_chat_role(admission: Admission) -> None:
    rejects(
        admission,
        make_request(messages=[("user", "hi"), ("robot", "x")]),
        "messages[1].role must be one of system, user, assistant, tool, got 'robot'",
    )


@pytest.mark.parametrize("top_p", [0.0, 1.5, -0.1])
def test_top_p_out_of_range(admission: Admission, top_p: float) -> None:
    rejects(admission, make_request("hi", top_p=top_p), "top_p must be in (0, 1]")


def test_negative_temperature(admission: Admission) -> None:
    rejects(admission, make_request("hi", temperature=-0.5), "temperature must be non-negative, got -0.5")


def test_top_k_below_minus_one(admission: Admission) -> None:
    rejects(admission, make_request("hi", top_k=-2), "top_k must be 0 or -1 (all tokens), or at least 1, got -2")


def test_empty_stop_string(admission: Admission) -> None:
    rejects(admission, make_request("hi", stop=["ok", ""]), "stop strings must be non-empty")


def test_request_id_too_long(admission: Admission) -> None:
    rejects(admission, make_request("hi", request_id="r" * 257), "request_id must be at most 256 printable characters")


def test_request_id_not_printable(admission: Admission) -> None:
    rejects(admission, make_request("hi", request_id="a\nb"), "request_id must be at most 256 printable characters")


def test_nan_temperature_is_rejected(admission: Admission) -> None:
    rejects(admission, make_request("hi", temperature=math.nan), "temperature")


def test_parallel_sampling_needs_temperature(admission: Admission) -> None:
    rejects(admission, make_request("hi", n=3, temperature=0.0), "n must be 1 when using greedy sampling (temperature 0), got 3")
    admitted = admission.admit(make_request("hi", n=3, temperature=0.7, seed=4))
    assert admitted.sampling.n == 3 and admitted.sampling.seed == 4


def test_sequence_seeds_are_distinct_and_the_first_is_the_request_seed() -> None:
    from shared.sampling_params import seed_for_sequence

    seeds = [seed_for_sequence(1234, i) for i in range(8)]
    assert seeds[0] == 1234 and len(set(seeds)) == 8
    assert all(0 <= s < 2**63 for s in seeds)
    assert seeds == [seed_for_sequence(1234, i) for i in range(8)]


def test_best_of_must_cover_n(admission: Admission) -> None:
    rejects(admission, make_request("hi", n=3, best_of=2, temperature=0.7),
            "best_of must be greater than or equal to n, got n=3 and best_of=2")
    admitted = admission.admit(make_request("hi", n=2, best_of=5, temperature=0.7))
    assert (admitted.sampling.n, admitted.sampling.best_of, admitted.sampling.num_sequences) == (2, 5, 5)
    assert not admitted.sampling.streams_outputs


def test_logprobs_range(admission: Admission) -> None:
    rejects(admission, make_request("hi", logprobs=21), "logprobs must be in [0, 20], got 21")
    assert admission.admit(make_request("hi", logprobs=0)).sampling.logprobs == 0
    assert admission.admit(make_request("hi")).sampling.logprobs is None


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2], got 3.0."),
        (dict(presence_penalty=-2.5), "presence_penalty must be in [-2, 2], got -2.5."),
        (dict(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2], got 2.5."),
        (dict(frequency_penalty=math.nan), "frequency_penalty must be in [-2, 2], got nan."),
        (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be greater than zero, got -1.0."),
        (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
        (dict(min_p=-0.5), "min_p must be in [0, 1], got -0.5."),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
        (dict(top_k=-3), "top_k must be 0 or -1 (all tokens), or at least 1, got -3."),
        (dict(temperature=-1.0), "temperature must be non-negative, got -1.0."),
        (dict(temperature=2.5), "temperature must be in [0, 2], got 2.5."),
        (dict(max_tokens=4, min_tokens=5), "min_tokens must be less than or equal to max_tokens=4, got 5."),
        (dict(min_tokens=17), "min_tokens must be less than or equal to max_tokens=16, got 17."),
        (dict(prompt_logprobs=21), "prompt_logprobs must be in [0, 20], got 21."),
        (dict(logprobs=21), "logprobs must be in [0, 20], got 21."),
        (dict(n=2, temperature=0.0), "n must be 1 when using greedy sampling (temperature 0), got 2."),
        (dict(best_of=3, temperature=0.0), "best_of must be 1 when using greedy sampling (temperature 0), got 3."),
        (dict(use_beam_search=True, best_of=2, temperature=0.0, min_p=0.1), "min_p must be 0 when using beam search."),
        (dict(use_beam_search=True, best_of=2, temperature=0.0, repetition_penalty=1.2),
         "presence_penalty, frequency_penalty and repetition_penalty are not supported with beam search."),
        (dict(use_beam_search=True, best_of=2, temperature=0.0, min_tokens=2),
         "min_tokens is not supported with beam search."),
        (dict(stop_token_ids=[2, 10**6]), "stop_token_ids contains ids outside the vocabulary"),
    ],
)
def test_invalid_sampling_parameter_is_rejected_with_its_message(
    admission: Admission, sampling: dict, message: str
) -> None:
    rejects(admission, make_request(prompt_token_ids=[5, 6, 7], **sampling), message)


def test_min_tokens_is_checked_against_the_resolved_max_tokens(admission: Admission) -> None:
    # max_tokens = 0 means the room left: 64 - 60 = 4 tokens, fewer than min_tokens.
    rejects(admission, make_request(prompt_token_ids=[7] * 60, max_tokens=0, min_tokens=5),
            "min_tokens must be less than or equal to max_tokens=4, got 5.")
    assert admission.admit(make_request(prompt_token_ids=[7] * 60, max_tokens=0, min_tokens=4)).sampling.min_tokens == 4


def test_min_tokens_below_zero_is_rejected_by_the_dataclass() -> None:
    # The wire field is unsigned; the dataclass (built directly by code) checks it too.
    with pytest.raises(ValueError, match=re.escape("min_tokens must be greater than or equal to 0, got -1.")):
        SamplingParams(min_tokens=-1)


def test_new_sampling_fields_are_carried_and_round_trip(admission: Admission) -> None:
    got = admission.admit(make_request(
        prompt_token_ids=[5, 6, 7], min_p=0.25, presence_penalty=0.5, frequency_penalty=-1.0,
        repetition_penalty=1.5, min_tokens=3, prompt_logprobs=2, include_stop_str_in_output=True,
        skip_special_tokens=False,
    ))
    s = got.sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.25, 0.5, -1.0, 1.5)
    assert (s.min_tokens, s.prompt_logprobs, s.include_stop_str_in_output, s.skip_special_tokens) == (3, 2, True, False)
    assert sampling_from_proto(to_record(got, [1], "w", 0.0).sampling) == s
    defaults = admission.admit(make_request(prompt_token_ids=[5, 6, 7])).sampling
    assert (defaults.repetition_penalty, defaults.skip_special_tokens, defaults.prompt_logprobs) == (1.0, True, None)


def test_spaces_between_special_tokens_defaults_to_true_and_round_trips(admission: Admission) -> None:
    assert admission.admit(make_request(prompt_token_ids=[5, 6, 7])).sampling.spaces_between_special_tokens
    got = admission.admit(make_request(prompt_token_ids=[5, 6, 7], spaces_between_special_tokens=False))
    assert not got.sampling.spaces_between_special_tokens
    assert sampling_from_proto(to_record(got, [1], "w", 0.0).sampling) == got.sampling


# -- hostile values (issue 9, item 5) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (dict(temperature=math.inf), "temperature must be non-negative, got inf"),
        (dict(temperature=math.nan), "temperature"),
        (dict(repetition_penalty=math.nan), "repetition_penalty must be greater than zero, got nan"),
        (dict(repetition_penalty=math.inf), "repetition_penalty must be greater than zero, got inf"),
        (dict(presence_penalty=math.inf), "presence_penalty"),
        (dict(use_beam_search=True, best_of=2, temperature=0.0, length_penalty=math.inf), "length_penalty"),
    ],
)
def test_non_finite_floats_are_rejected(admission: Admission, sampling: dict, message: str) -> None:
    rejects(admission, make_request(prompt_token_ids=[5, 6, 7], **sampling), message)


def test_largest_max_tokens_is_rejected_with_the_context_limit(admission: Admission) -> None:
    rejects(admission, make_request(prompt_token_ids=[5, 6, 7], max_tokens=2**32 - 1), "lower max_tokens")


def test_more_sequences_than_a_step_runs_are_rejected(tokenizer) -> None:
    limited = Admission(tokenizer, ModelLimits(max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer), max_num_seqs=4))
    rejects(limited, make_request("hi", n=5, temperature=1.0), "runs 5 sequences at once (n / best_of)")
    rejects(limited, make_request("hi", n=1, best_of=6, temperature=1.0), "at most 4 (--max-num-seqs)")
    rejects(limited, make_request("hi", use_beam_search=True, best_of=5, temperature=0.0), "lower n or best_of")
    # Beam search runs best_of beams at once (its 2 * best_of ids hold finished hypotheses too).
    assert limited.admit(make_request("hi", use_beam_search=True, best_of=4, temperature=0.0)).sampling.best_of == 4


def test_token_ids_cannot_be_negative_on_the_wire() -> None:
    """prompt_token_ids is repeated uint32: a negative id cannot even be built, so admission never sees one."""
    with pytest.raises(ValueError):
        generation_pb2.GenerateRequest(prompt_token_ids=[-1])


# -- prompt options --------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(admission: Admission, tokenizer) -> None:
    ids = list(range(100, 140))
    got = admission.admit(generation_pb2.GenerateRequest(prompt_token_ids=ids, truncate_prompt_tokens=5))
    assert got.prompt_token_ids == ids[-5:]
    text = "one two three four five six seven eight nine ten"
    got = admission.admit(generation_pb2.GenerateRequest(prompt=text, truncate_prompt_tokens=3))
    assert got.prompt_token_ids == tokenizer(text).input_ids[-3:]
    # -1: the model's context length (all of a shorter prompt).
    assert admission.admit(generation_pb2.GenerateRequest(prompt_token_ids=ids, truncate_prompt_tokens=-1)
                           ).prompt_token_ids == ids
    rejects(admission, generation_pb2.GenerateRequest(prompt_token_ids=ids, truncate_prompt_tokens=0),
            "truncate_prompt_tokens must be at least 1")
    # Unset keeps the whole prompt.
    assert admission.admit(generation_pb2.GenerateRequest(prompt_token_ids=ids)).prompt_token_ids == ids


class _RecordingTokenizer:
    """Answers one token per call and records whether special tokens were asked for."""

    eos_token_id = 0
    chat_template = "x"

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> object:
        self.calls.append(add_special_tokens)
        return type("Encoding", (), {"input_ids": [1]})()

    def apply_chat_template(self, conv: list, tools: list | None, tokenize: bool, add_generation_prompt: bool,
                            continue_final_message: bool) -> str:
        return "rendered"


def test_add_special_tokens_reaches_the_tokenizer() -> None:
    tok = _RecordingTokenizer()
    admission = Admission(tok, ModelLimits(max_model_len=64, vocab_size=10))
    chat = [generation_pb2.ChatMessage(role="user", content="hi")]
    for request in (generation_pb2.GenerateRequest(prompt="a"),
                    generation_pb2.GenerateRequest(prompt="a", add_special_tokens=False),
                    generation_pb2.GenerateRequest(messages=chat),
                    generation_pb2.GenerateRequest(messages=chat, add_special_tokens=True)):
        admission.admit(request)
    # Defaults: special tokens for a text prompt, none after a rendered template.
    assert tok.calls == [True, False, False, True]
    rejects(admission, generation_pb2.GenerateRequest(prompt_token_ids=[1, 2], add_special_tokens=True),
            "add_special_tokens applies to a text prompt or messages")
    # Tokenize takes the same option (vLLM's /tokenize, which its benchmark client calls without special tokens).
    tok.calls.clear()
    tok.convert_ids_to_tokens = lambda ids: [str(i) for i in ids]  # type: ignore[attr-defined]
    admission.tokenize(generation_pb2.TokenizeRequest(prompt="a", add_special_tokens=False))
    admission.tokenize(generation_pb2.TokenizeRequest(prompt="a"))
    admission.tokenize(generation_pb2.TokenizeRequest(messages=chat, add_special_tokens=True))
    assert tok.calls == [False, True, True]


def test_logit_bias_and_allowed_token_ids_are_checked_and_round_trip(admission: Admission, tokenizer) -> None:
    got = admission.admit(make_request(prompt_token_ids=[5, 6, 7], logit_bias={9: 2.5, 11: -100.0},
                                       allowed_token_ids=[9, 11, 13]))
    assert (got.sampling.logit_bias, got.sampling.allowed_token_ids) == ({9: 2.5, 11: -100.0}, [9, 11, 13])
    assert sampling_from_proto(to_record(got, [1], "w", 0.0).sampling) == got.sampling
    outside = len(tokenizer)
    rejects(admission, make_request(prompt_token_ids=[5], logit_bias={outside: 1.0}),
            "logit_bias contains ids outside the vocabulary")
    rejects(admission, make_request(prompt_token_ids=[5], allowed_token_ids=[outside]),
            "allowed_token_ids contains ids outside the vocabulary")
    rejects(admission, make_request(prompt_token_ids=[5], logit_bias={9: 200.0}), "logit_bias needs")


def test_bad_words_are_tokenized_with_and_without_a_leading_space(admission: Admission, tokenizer) -> None:
    got = admission.admit(make_request(prompt_token_ids=[5, 6, 7], bad_words=["hello", " world"]))
    expected = []
    for word in ("hello", "world"):
        bare = tokenizer(word, add_special_tokens=False).input_ids
        spaced = tokenizer(" " + word, add_special_tokens=False).input_ids
        expected.append(bare)
        if spaced != bare:
            expected.append(spaced)
    assert got.sampling.bad_words_token_ids == expected and len(expected) > 2
    assert sampling_from_proto(to_record(got, [1], "w", 0.0).sampling) == got.sampling
    rejects(admission, make_request(prompt_token_ids=[5], bad_words=["  "]), "bad_words must be non-empty")
    hello = tokenizer("hello", add_special_tokens=False).input_ids
    assert len(hello) == 1  # one token: masked wherever it would come
    rejects(admission, make_request(prompt_token_ids=[5], bad_words=["hello"], allowed_token_ids=hello),
            "every id in allowed_token_ids is a bad word")
    assert admission.admit(make_request(prompt_token_ids=[5], bad_words=["hello"], allowed_token_ids=[*hello, 9]))
    sent = make_request(prompt_token_ids=[5])
    sent.sampling.bad_words_token_ids.add(ids=[3])
    rejects(admission, sent, "bad_words_token_ids is set by the scheduler")


def test_structured_outputs_are_compiled_once_and_bad_ones_refused(admission: Admission) -> None:
    choice = common_pb2.StructuredOutputs(choice=common_pb2.Choices(choices=["yes", "no"]))
    got = admission.admit(make_request(prompt_token_ids=[5], structured_outputs=choice))
    assert got.sampling.structured_outputs is not None
    assert got.sampling.structured_outputs.compiled == 'start: "yes" | "no"'
    # The compiled grammar travels with the record, so every worker that learns the sequence gets it.
    assert sampling_from_proto(to_record(got, [1], "w", 0.0).sampling) == got.sampling
    rejects(admission, make_request(prompt_token_ids=[5], structured_outputs=common_pb2.StructuredOutputs(regex="(")),
            "structured_outputs.regex is not valid")
    rejects(admission, make_request(prompt_token_ids=[5], structured_outputs=common_pb2.StructuredOutputs(
        json='{"type": "object", "properties": {"a": {"type": "nope"}}}')), "structured_outputs.json is not valid")
    rejects(admission, make_request(prompt_token_ids=[5], structured_outputs=common_pb2.StructuredOutputs()),
            "structured_outputs must set exactly one of")
    rejects(admission, make_request(prompt_token_ids=[5], structured_outputs=common_pb2.StructuredOutputs(
        regex="a", compiled="start: /b/")), "structured_outputs.compiled is set by the scheduler")
