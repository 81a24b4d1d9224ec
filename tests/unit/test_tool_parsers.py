"""Tool calls read from a model's free text (tool_choice "auto"): content and calls come out the same however the
text is split into pieces, nothing that looks like a call leaks into the content before it is known not to be
one, and text that is no call is handed back whole."""

from __future__ import annotations

import json
import random

import pytest

from openai_api.tool_parsers import HermesParser, Llama3JsonParser, Parsed, make_parser

WEATHER = ("get_weather", json.dumps({"city": "Paris"}))
TIME = ("get_time", json.dumps({}))


def _read(parser_name: str, pieces: list[str]) -> Parsed:
    parser, out = make_parser(parser_name), Parsed()
    for piece in pieces:
        got = parser.feed(piece)
        out.content += got.content
        out.calls += got.calls
    end = parser.finish()
    out.content += end.content
    out.calls += end.calls
    return out


def _splits(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and in random pieces."""
    rng = random.Random(len(text))
    random_pieces = []
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        random_pieces.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return [[text], list(text), *random_pieces]


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [WEATHER]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "\n", [WEATHER, TIME]),
    # A list in one block, and arguments written as JSON text.
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}, '
               '{"name": "get_time", "arguments": {}}]</tool_call>', "", [WEATHER, TIME]),
    # Text that begins like the tag, and a block that is no call, come back as they were.
    ("hermes", "x < y and <tool> is not <tool_call>not json</tool_call> ok <tool_c",
     "x < y and <tool> is not <tool_call>not json</tool_call> ok <tool_c", []),
    # A block the model never closed (it stopped at its end-of-turn) is still its call.
    ("hermes", 'Sure <tool_call>{"name": "get_time", "arguments": {}}', "Sure ", [TIME]),
    ("hermes", "Sure <tool_call>{\"name\": \"get_ti", 'Sure <tool_call>{"name": "get_ti', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     "", [WEATHER, TIME]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": {}}', "", [TIME]),
    ("llama3_json", ' \n{"name": "get_time", "parameters": {}}', "", [TIME]),
    ("llama3_json", 'It is {"name": "get_time", "parameters": {}}', 'It is {"name": "get_time", "parameters": {}}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    # Cut short: the complete call, then the rest as text.
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"ci',
     '{"name": "get_weather", "parameters": {"ci', [TIME]),
])
def test_content_and_calls_do_not_depend_on_how_the_text_arrives(parser: str, text: str, content: str,
                                                                  calls: list) -> None:
    for pieces in _splits(text):
        got = _read(parser, pieces)
        assert (got.content, got.calls) == (content, calls), pieces


def test_hermes_holds_back_only_what_may_become_a_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Let me <").content == "Let me "
    assert parser.feed("b>").content == "<b>"  # not the tag after all
    assert parser.feed("<tool_").content == ""
    assert parser.feed('call>{"name": "get_time", "arguments": {}}').content == ""
    got = parser.feed("</tool_call> done")
    assert got.calls == [TIME] and got.content == " done"


def test_llama3_json_streams_plain_answers_at_once_and_calls_when_whole() -> None:
    parser = Llama3JsonParser()
    assert parser.feed("  ") == Parsed()  # undecided
    assert parser.feed("Hello").content == "  Hello"
    assert parser.feed(" there").content == " there"
    calls = Llama3JsonParser()
    assert calls.feed('{"name": "get_time", "parameters": {}') == Parsed()
    assert calls.feed("}").calls == [TIME]


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="one of hermes, llama3_json, got 'mistral'"):
        make_parser("mistral")
