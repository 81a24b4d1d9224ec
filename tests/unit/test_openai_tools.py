"""Tool calling in the OpenAI front: tool_choice -> the constraint, the tools and tool messages on the wire, and a
choice's text read back as tool calls, whole or as it streams in."""

from __future__ import annotations

import json

import jsonschema
import pytest

from openai_api.errors import OpenAIError
from openai_api.protocol import ChatCompletionRequest, TokenizeRequest
from openai_api.request_mapping import chat_request, tokenize_request
from openai_api.tools import ToolCallMode, ToolCallReader, ToolDeltas, constraint_error, tool_call_mode

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: any object
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": MESSAGES, "tools": TOOLS, **fields})


def _chat(req: ChatCompletionRequest, tool_parser: str | None = None):
    return chat_request(req, "chat-1", tool_call_mode(req, tool_parser))


def _schema(**fields: object) -> dict:
    msg = _chat(_request(**fields))
    assert msg.sampling.structured_outputs.disable_any_whitespace  # compact arguments
    return json.loads(msg.sampling.structured_outputs.json)


def test_tool_choice_modes() -> None:
    assert tool_call_mode(ChatCompletionRequest(messages=MESSAGES)) is None
    # Without tools "auto" is a text answer, as OpenAI's.
    assert tool_call_mode(ChatCompletionRequest(messages=MESSAGES, tool_choice="auto")) is None
    assert tool_call_mode(_request(tool_choice="none")) is None
    assert tool_call_mode(_request(tool_choice="required")) == ToolCallMode()
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_call_mode(_request(tool_choice=named)) == ToolCallMode("get_weather")
    # "auto" (the default with tools) reads the model's own syntax, with a parser.
    assert tool_call_mode(_request(), "hermes") == tool_call_mode(_request(tool_choice="auto"), "hermes") == \
        ToolCallMode(parser="hermes")
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice --tool-call-parser"):
        tool_call_mode(_request())


@pytest.mark.parametrize("choice", ["any", {"type": "function"}, {"type": "function", "function": {}}, 3])
def test_a_tool_choice_of_no_known_form_is_named(choice: object) -> None:
    with pytest.raises(OpenAIError) as info:
        tool_call_mode(_request(tool_choice=choice))
    assert info.value.param == "tool_choice" and info.value.message.startswith(
        'tool_choice must be "none", "auto", "required" or {"type": "function"')


def test_the_schedulers_refusal_of_the_constraint_names_the_tools() -> None:
    refused = OpenAIError(400, "structured_outputs.json is not valid: Invalid type: objekt")
    named = constraint_error(ToolCallMode("get_weather"), refused)
    assert (named.param, named.message) == ("tools", "get_weather's parameters are not a JSON schema the output can "
                                                     "be held to: Invalid type: objekt")
    assert constraint_error(ToolCallMode(), refused).message.startswith("the tools' parameters are not")
    beam = constraint_error(ToolCallMode(), OpenAIError(400, "structured outputs are not supported with beam search."))
    assert (beam.param, beam.message) == ("tool_choice", "structured outputs are not supported with beam search. "
                                                         "(tool_choice required constrains the output with structured "
                                                         "outputs)")
    # Other errors, and those of a request whose constraint is its own, pass as they are.
    for mode, error in ((ToolCallMode(), OpenAIError(429, "busy")), (None, refused),
                        (ToolCallMode(parser="hermes"), refused)):
        assert constraint_error(mode, error) is error


def test_auto_leaves_the_output_free_and_shows_special_tokens_to_the_parser() -> None:
    msg = _chat(_request(), tool_parser="hermes")
    assert not msg.sampling.HasField("structured_outputs") and msg.sampling.skip_special_tokens is False
    assert len(msg.chat_options.tools) == 2


def test_a_named_function_constrains_the_output_to_its_parameters() -> None:
    assert _schema(tool_choice={"type": "function", "function": {"name": "get_weather"}}) == WEATHER
    assert _schema(tool_choice={"type": "function", "function": {"name": "get_time"}}) == {"type": "object"}


def test_required_constrains_the_output_to_an_array_of_calls() -> None:
    schema = _schema(tool_choice="required")
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"name": "get_time"}], [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = _schema(tool_choice="required", parallel_tool_calls=False)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)


def test_none_sends_the_tools_to_the_template_without_a_constraint() -> None:
    msg = _chat(_request(tool_choice="none"))
    assert not msg.sampling.HasField("structured_outputs")
    assert [(t.name, t.description, t.parameters) for t in msg.chat_options.tools] == [
        ("get_weather", "The weather now", json.dumps(WEATHER)), ("get_time", "", "")]


def test_tool_messages_travel_on_the_wire() -> None:
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
                    {"id": "call-1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "18 C", "tool_call_id": "call-1"}]
    msg = _chat(_request(messages=messages, tool_choice="none"))
    assistant, tool = msg.messages[1], msg.messages[2]
    assert assistant.reasoning == "Look it up."  # DeepSeek's name of it; vLLM's `reasoning` is read too
    assert assistant.content == "" and [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call-1", "get_weather", '{"city": "Paris"}')]
    assert (tool.role, tool.content, tool.tool_call_id) == ("tool", "18 C", "call-1")
    tokenize = tokenize_request(TokenizeRequest(messages=messages, tools=TOOLS))
    assert tokenize.messages == msg.messages and tokenize.chat_options.tools == msg.chat_options.tools
    with pytest.raises(OpenAIError) as info:
        tokenize_request(TokenizeRequest(prompt="hi", tools=TOOLS))
    assert info.value.param == "tools"


def _feed_by_character(reader: ToolCallReader, text: str) -> list[tuple[int, list[dict]]]:
    """(position after which, deltas) for every character that produced deltas."""
    return [(i, deltas) for i, ch in enumerate(text) if (deltas := reader.feed(ch).tool_calls)]


def test_required_calls_stream_once_each_object_is_complete() -> None:
    text = '[ {"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\" {x}"}} ,\n{"name": "get_time", ' \
           '"parameters": {}}]'
    reader = ToolCallReader(ToolCallMode())
    emitted = _feed_by_character(reader, text)
    # Each call arrives at its closing brace (braces and quotes inside strings do not close it), whole.
    first_end = text.index("}} ,") + 1
    assert [i for i, _ in emitted] == [first_end, len(text) - 2]
    deltas = [d for _, ds in emitted for d in ds]
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == [
        (0, "get_weather", {"city": 'Paris, "FR" {x}'}), (1, "get_time", {})]
    assert all(d["type"] == "function" and d["id"].startswith("chatcmpl-tool-") for d in deltas)
    assert [c["id"] for c in reader.calls] == [d["id"] for d in deltas]
    assert reader.finish() == ToolDeltas() and reader.finish_reason("stop") == "tool_calls"
    # Read whole, the same calls.
    whole = ToolCallReader(ToolCallMode())
    whole.read(text, final=True)
    assert [c["function"] for c in whole.calls] == [c["function"] for c in reader.calls]


def test_a_required_array_cut_short_keeps_its_complete_calls_and_returns_the_rest_as_text() -> None:
    reader = ToolCallReader(ToolCallMode())
    reader.feed('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci')
    assert [c["function"]["name"] for c in reader.calls] == ["get_time"]
    assert reader.finish().content == '{"name": "get_weather", "parameters": {"ci'
    assert reader.finish_reason("length") == "length"
    empty = ToolCallReader(ToolCallMode())
    empty.feed('[{"na')
    assert empty.calls == [] and empty.finish_reason("stop") == "stop"
    # The rest is the call's text as generated, to its last character.
    cut = ToolCallReader(ToolCallMode())
    assert cut.read('[{"name": "get_time", "parameters": {"zones": [', final=True).content == \
        '{"name": "get_time", "parameters": {"zones": ['
    closed = ToolCallReader(ToolCallMode())
    assert closed.read('[{"name": "get_time", "parameters": {}} ]', final=True).content == ""


def test_a_named_call_streams_its_arguments_as_generated() -> None:
    reader = ToolCallReader(ToolCallMode("get_weather"))
    assert reader.feed("") == ToolDeltas()
    (first,) = reader.feed('{"ci').tool_calls
    assert first["index"] == 0 and first["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert reader.feed('ty": "Paris"}') == ToolDeltas(
        tool_calls=[{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}])
    (call,) = reader.calls
    assert call["id"] == first["id"] and call["function"]["arguments"] == '{"city": "Paris"}'
    assert reader.finish() == ToolDeltas() and reader.finish_reason("stop") == "tool_calls"
