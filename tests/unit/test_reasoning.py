"""Reasoning split off a choice's text (the front's --reasoning-parser), alone and with tool calls read from the
rest: the same fields however the text arrives, nothing of a tag before it is known, nothing lost."""

from __future__ import annotations

import json
import random

import pytest

from openai_api.choice_text import ChoiceText, choice_reader
from openai_api.protocol import ChatCompletionRequest
from openai_api.reasoning import ReasoningSplitter, Split
from openai_api.request_mapping import chat_request
from openai_api.tools import ToolCallMode, tool_call_mode


def _split(parser: str, pieces: list[str], constrained: bool = False) -> Split:
    splitter, out = ReasoningSplitter(parser, constrained), Split()
    for i, piece in enumerate(pieces):
        got = splitter.read(piece, final=i == len(pieces) - 1)
        out.reasoning += got.reasoning
        out.content += got.content
    return out


def _pieces(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    out = [[text], list(text) or [""]]
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(5, max(len(text) - 1, 0)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("deepseek_r1", "The user greets me.\n</think>\n\nHello!", "The user greets me.\n", "\n\nHello!"),
    ("deepseek_r1", "<think>Greeting.</think>Hi", "Greeting.", "Hi"),  # the model wrote the opening tag itself
    ("deepseek_r1", "Still thinking, cut short </thi", "Still thinking, cut short </thi", ""),
    ("deepseek_r1", "a < b and </b> is not </think", "a < b and </b> is not </think", ""),
    ("qwen3", "<think>\nGreeting.\n</think>\n\nHello!", "\nGreeting.\n", "\n\nHello!"),
    ("qwen3", "\n<think>x</think>y", "x", "y"),
    ("qwen3", "Hello! <think> is a tag", "", "Hello! <think> is a tag"),  # thinking only where the output opens it
    ("qwen3", "<thin", "", "<thin"),
    ("qwen3", "", "", ""),
])
def test_the_split_does_not_depend_on_how_the_text_arrives(parser: str, text: str, reasoning: str, content: str
                                                           ) -> None:
    for pieces in _pieces(text):
        got = _split(parser, pieces)
        assert (got.reasoning, got.content) == (reasoning, content), pieces


def test_a_tag_is_held_back_only_while_it_may_be_one() -> None:
    splitter = ReasoningSplitter("deepseek_r1")
    assert splitter.read("Thinking </", final=False) == Split(reasoning="Thinking ")
    assert splitter.read("b> more", final=False) == Split(reasoning="</b> more")
    assert splitter.read("</think>Answer", final=False) == Split(content="Answer")
    opening = ReasoningSplitter("qwen3")
    assert opening.read("<th", final=False) == Split()
    assert opening.read("ink>x", final=False) == Split(reasoning="x")


def test_a_constrained_output_is_not_inside_a_thinking_it_did_not_open() -> None:
    assert _split("deepseek_r1", ['{"a": 1}'], constrained=True) == Split(content='{"a": 1}')
    assert _split("deepseek_r1", ["<think>plan</think>", '{"a": 1}'], constrained=True) == Split("plan", '{"a": 1}')


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], **fields)


def _reader(req: ChatCompletionRequest, tool_parser: str | None = None, reasoning_parser: str | None = None):
    """The choices' reader as the route makes it: from the request's tool mode and the request it sends."""
    mode = tool_call_mode(req, tool_parser)
    return choice_reader(req, mode, chat_request(req, "chat-1", mode), reasoning_parser)


TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def test_reasoning_then_a_call_in_the_models_syntax_streamed_and_whole() -> None:
    text = ('<think>The user wants the weather.</think>Checking.<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}</tool_call>')
    new = _reader(_request(tools=TOOLS), "hermes", "qwen3")
    whole = new().message(text)
    assert whole["reasoning"] == whole["reasoning_content"] == "The user wants the weather."
    assert whole["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    for pieces in _pieces(text):
        reader, fields = new(), {"reasoning": "", "content": "", "calls": []}
        for i, piece in enumerate(pieces):
            delta = reader.delta(piece, final=i == len(pieces) - 1)
            assert delta.get("reasoning") == delta.get("reasoning_content")
            fields["reasoning"] += delta.get("reasoning") or ""
            fields["content"] += delta.get("content", "")
            fields["calls"] += [(c["function"]["name"], c["function"]["arguments"])
                                for c in delta.get("tool_calls", [])]
        assert fields == {"reasoning": "The user wants the weather.", "content": "Checking.",
                          "calls": [("get_weather", '{"city": "Paris"}')]}, pieces
        assert reader.finish_reason("stop") == "tool_calls"


def test_include_reasoning_false_and_plain_text() -> None:
    hidden = _reader(_request(include_reasoning=False), reasoning_parser="deepseek_r1")
    assert hidden().message("plan</think>answer") == {"content": "answer"}
    assert hidden().delta("plan</think>answer", final=True) == {"content": "answer"}
    # All reasoning, no content: the content is null, as a call's.
    assert ChoiceText(None, "deepseek_r1", True).message("no end") == {
        "content": None, "reasoning": "no end", "reasoning_content": "no end"}
    plain = ChoiceText(None, None, True)
    assert plain.plain and plain.message("") == {"content": ""} and plain.delta("", final=True) == {}
    # A constrained request: the text is what the grammar allowed, content unless it opened a thinking.
    constrained = _reader(_request(response_format={"type": "json_object"}), reasoning_parser="deepseek_r1")()
    assert constrained.message('{"a": 1}') == {"content": '{"a": 1}', "reasoning": None, "reasoning_content": None}
    named = _reader(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                    reasoning_parser="deepseek_r1")()
    assert named.message('{"city": "Paris"}')["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert ToolCallMode("get_weather").constrained
