"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The tools always reach the chat template (ChatOptions.tools), which describes them to the model if it knows how.
What `tool_choice` does, as vLLM serves it:
- "none" (the default without tools): a text answer.
- a named function, `{"type": "function", "function": {"name": ...}}`: the output is constrained to that
  function's `parameters` schema (structured outputs) and comes back as one tool call whose `arguments` are the
  generated JSON; a stream sends them as they are generated.
- "required": the output is constrained to a JSON array of `{"name": <a tool's>, "parameters": <its schema>}`
  objects (at least one; exactly one with `parallel_tool_calls: false`), each returned as a tool call; a stream
  sends each call once its object is complete.
- "auto" (the default with tools): the output is free, and the front's parser of the model's call syntax
  (--tool-call-parser, tool_parsers.py) reads calls from the text, the rest being content; without a parser it is
  a 400 (as vLLM answers without --enable-auto-tool-choice).
A choice that made a call and ended by a stop has finish_reason "tool_calls". Text of an array cut short (by
`max_tokens`) that holds no complete call comes back as `content`, after the calls that were complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from openai_api.errors import OpenAIError, invalid_request
from openai_api.protocol import ChatCompletionRequest, NamedToolChoice
from openai_api.tool_parsers import Parsed, calls_of, make_parser, next_json_value
from protos import common_pb2

# Arguments of a function that declares no parameters: any object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_WHITESPACE = " \t\n\r"
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCallMode:
    """How a request's output becomes tool calls: `name` for a named function, `parser` for "auto" (the model's
    syntax, read from free text), neither for "required"'s array."""

    name: str | None = None
    parser: str | None = None

    @property
    def constrained(self) -> bool:
        """Whether the output is constrained to the calls (all but "auto")."""
        return self.parser is None


def tool_call_mode(req: ChatCompletionRequest, parser: str | None = None) -> ToolCallMode | None:
    """The request's tool calling (`parser`: the front's --tool-call-parser); None for a text answer. A 400 for a
    choice that cannot be served."""
    choice = _choice(req.tool_choice)
    if choice is None:
        choice = "auto" if req.tools else "none"
    if choice == "none" or (choice == "auto" and not req.tools):
        return None
    if choice == "auto":
        if parser is None:
            raise invalid_request(
                'tool_choice "auto" (the default with tools) needs a parser of the model\'s tool-call syntax: start '
                'the front with --enable-auto-tool-choice --tool-call-parser NAME, or set tool_choice to "required", '
                '"none" or {"type": "function", "function": {"name": ...}}', "tool_choice")
        return ToolCallMode(parser=parser)
    if not req.tools:
        raise invalid_request("tool_choice asks for a tool call, but the request has no tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in req.tools}:
            raise invalid_request(f"tool_choice names {choice.function.name!r}, which is not one of the tools",
                                  "tool_choice.function.name")
        return ToolCallMode(choice.function.name)
    return ToolCallMode()


def _choice(value: object) -> str | NamedToolChoice | None:
    """tool_choice, checked here rather than by the request model: a union's error would name its branches' types."""
    if value is None or value in _CHOICES:
        return value  # type: ignore[return-value]
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError:
            pass
    raise invalid_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")


def constraint_error(mode: ToolCallMode | None, error: OpenAIError) -> OpenAIError:
    """The scheduler's refusal of the constraint built from the tools' parameters, in the request's terms (it names
    the structured output the front made of them)."""
    prefix = "structured_outputs.json is not valid: "
    if mode is None or not mode.constrained or error.status != 400:
        return error
    if error.message.startswith(prefix):
        whose = f"{mode.name}'s parameters are" if mode.name else "the tools' parameters are"
        return invalid_request(f"{whose} not a JSON schema the output can be held to: {error.message[len(prefix):]}",
                               "tools")
    if "structured output" in error.message:  # e.g. "structured outputs are not supported with beam search"
        return invalid_request(f"{error.message} (tool_choice {'a named function' if mode.name else 'required'} "
                               f"constrains the output with structured outputs)", "tool_choice")
    return error


def tool_constraint(req: ChatCompletionRequest, mode: ToolCallMode) -> common_pb2.StructuredOutputs:
    """The structured output that makes the model's text the call(s). Compact JSON (no whitespace but after the
    separators, as json.dumps writes it): whitespace in arguments means nothing, costs tokens, and a sampled model
    can run on in it until max_tokens (on the default model at temperature 0.7, 64 chats constrained to one
    function's parameters took 1,404 tokens, one of them running out, with any whitespace allowed; 914 and none
    compact)."""
    tools = {t.function.name: t.function.parameters or _ANY_OBJECT for t in req.tools or []}
    if mode.name is not None:
        return common_pb2.StructuredOutputs(json=json.dumps(tools[mode.name]), disable_any_whitespace=True)
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, schema in tools.items()]}}
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return common_pb2.StructuredOutputs(json=json.dumps(calls), disable_any_whitespace=True)


def tool_call_id() -> str:
    """A new call's id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolDeltas:
    """What a piece of a choice's text adds: content, and deltas of OpenAI's `tool_calls`."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallReader:
    """Reads one choice's tool calls from its text as it grows (`feed`), then what is left at its end (`finish`);
    `calls` holds the calls whole, for a response that is not streamed."""

    def __init__(self, mode: ToolCallMode) -> None:
        self.mode = mode
        self.calls: list[dict[str, Any]] = []
        self._array = _CallArray() if mode.name is None and mode.parser is None else None
        self._parser = make_parser(mode.parser) if mode.parser is not None else None

    def feed(self, text: str) -> ToolDeltas:
        if not text:
            return ToolDeltas()
        if self.mode.name is not None:
            if not self.calls:
                return ToolDeltas(tool_calls=[self._add(self.mode.name, text)])
            self.calls[0]["function"]["arguments"] += text
            return ToolDeltas(tool_calls=[{"index": 0, "function": {"arguments": text}}])
        if self._array is not None:
            return ToolDeltas(tool_calls=[self._add(name, arguments) for name, arguments in self._array.feed(text)])
        return self._deltas(self._parser.feed(text))  # type: ignore[union-attr]

    def finish(self) -> ToolDeltas:
        """Text held back that is no complete call: "required"'s array cut short, a parser's rest."""
        if self._array is not None:
            return ToolDeltas(self._array.rest())
        if self._parser is not None:
            return self._deltas(self._parser.finish())
        return ToolDeltas()

    def read(self, text: str, final: bool) -> ToolDeltas:
        """feed(text), and finish() after it when the text is the choice's last."""
        deltas = self.feed(text)
        if final:
            rest = self.finish()
            deltas.content += rest.content
            deltas.tool_calls += rest.tool_calls
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason of the choice: "tool_calls" for a stop after a call."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _deltas(self, parsed: Parsed) -> ToolDeltas:
        return ToolDeltas(parsed.content, [self._add(name, arguments) for name, arguments in parsed.calls])

    def _add(self, name: str, arguments: str) -> dict[str, Any]:
        """A new call, and its first delta (a copy: a named call's arguments grow in `calls`)."""
        call_id = tool_call_id()
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        return {"index": len(self.calls) - 1, "id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}


class _CallArray:
    """The text of "required"'s constrained JSON array of {"name", "parameters"} objects as it grows: each object
    once it is whole, as (name, arguments JSON)."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._text += text
        if "}" not in text:
            return []  # an object completes only at a closing brace: a long call is not parsed again per piece
        found = []
        # The array's brackets and commas are skipped as separators: its items are objects.
        while (whole := next_json_value(self._text, self._pos, "[,]")) is not None:
            calls = calls_of(whole[0])
            if calls is None:
                break  # not a call (the grammar rules it out): left for rest()
            found += calls
            self._pos = whole[1]
        return found

    def rest(self) -> str:
        """Text after the last complete call, from the next call's beginning; "" when only the array's end is left."""
        rest = self._text[self._pos:].lstrip(_WHITESPACE + "[,")
        return rest if rest.strip(_WHITESPACE + "]") else ""
