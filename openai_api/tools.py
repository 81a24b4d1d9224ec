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
- "auto" (the default with tools): the model chooses between text and calls, and a parser for its model's
  call syntax would read them from the text; this front has none, so it is a 400 (as vLLM answers without
  --enable-auto-tool-choice).
A choice that made a call and ended by a stop has finish_reason "tool_calls". Text of an array cut short (by
`max_tokens`) that holds no complete call comes back as `content`, after the calls that were complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from openai_api.errors import invalid_request
from openai_api.protocol import ChatCompletionRequest, NamedToolChoice
from protos import common_pb2

# Arguments of a function that declares no parameters: any object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_JSON = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ToolCallMode:
    """How a request's output becomes tool calls: `name` set for a named function, else "required"'s array."""

    name: str | None = None


def tool_call_mode(req: ChatCompletionRequest) -> ToolCallMode | None:
    """The request's tool calling; None for a text answer. A 400 for a choice that cannot be served."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    if choice == "none" or (choice == "auto" and not req.tools):
        return None
    if choice == "auto":
        raise invalid_request('tool_choice "auto" (the default with tools) needs a parser of the model\'s tool-call '
                              'syntax, which this server does not have: set tool_choice to "required", "none" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if not req.tools:
        raise invalid_request("tool_choice asks for a tool call, but the request has no tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in req.tools}:
            raise invalid_request(f"tool_choice names {choice.function.name!r}, which is not one of the tools",
                                  "tool_choice.function.name")
        return ToolCallMode(choice.function.name)
    return ToolCallMode()


def tool_constraint(req: ChatCompletionRequest, mode: ToolCallMode) -> common_pb2.StructuredOutputs:
    """The structured output that makes the model's text the call(s)."""
    tools = {t.function.name: t.function.parameters or _ANY_OBJECT for t in req.tools or []}
    if mode.name is not None:
        return common_pb2.StructuredOutputs(json=json.dumps(tools[mode.name]))
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, schema in tools.items()]}}
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return common_pb2.StructuredOutputs(json=json.dumps(calls))


def tool_call_id() -> str:
    """A new call's id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallReader:
    """Reads one choice's tool calls from its text as it grows: `feed` returns the deltas of OpenAI's
    `tool_calls` that the new text completes, `rest` the text that is no complete call (at the end)."""

    mode: ToolCallMode
    calls: list[dict[str, Any]] = field(default_factory=list)
    _text: str = ""
    _pos: int = 0
    _opened: bool = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self._text += text
        if self.mode.name is not None:
            return self._named(text)
        return [self._add(value["name"], json.dumps(value["parameters"], ensure_ascii=False))
                for value in self._complete_elements()]

    def rest(self) -> str | None:
        """Text after the last complete call ("required"'s array cut short), None when there is none."""
        if self.mode.name is not None:
            return None
        rest = self._text[self._pos:].strip(_WHITESPACE + ",]")
        return rest or None

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason of the choice: "tool_calls" for a stop after a call."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _named(self, text: str) -> list[dict[str, Any]]:
        if not self.calls:
            return [self._add(self.mode.name, text)]  # type: ignore[arg-type]
        self.calls[0]["function"]["arguments"] += text
        return [{"index": 0, "function": {"arguments": text}}]

    def _add(self, name: str, arguments: str) -> dict[str, Any]:
        """A new call, and its first delta (a copy: a named call's arguments grow in `calls`)."""
        call_id = tool_call_id()
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        return {"index": len(self.calls) - 1, "id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _complete_elements(self) -> list[dict[str, Any]]:
        """The array's objects that the text now holds whole (the grammar guarantees their shape)."""
        found = []
        text = self._text
        while True:
            pos = self._pos
            while pos < len(text) and text[pos] in _WHITESPACE:
                pos += 1
            if pos == len(text):
                return found
            if not self._opened or text[pos] in ",]":
                self._opened = self._opened or text[pos] == "["
                self._pos = pos + 1
                continue
            try:
                value, end = _JSON.raw_decode(text, pos)
            except ValueError:
                return found  # the object is not complete yet
            if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                    and isinstance(value.get("parameters"), dict)):
                return found  # not a call: left for rest()
            found.append(value)
            self._pos = end
