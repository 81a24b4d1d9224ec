"""Chat messages and tools of a request -> the conversation and tools a chat template is rendered with.

transformers' apply_chat_template takes OpenAI-shaped dictionaries: messages with `role` and `content`, an
assistant's `tool_calls` with each call's arguments as an object (the wire carries them as JSON text) and its
`reasoning_content` (the name reasoning models' templates read), a tool message's `tool_call_id`, and
`tools=[{"type": "function", "function": {...}}]`. Templates that know nothing of tools ignore these keys; those
that do (Llama 3.1, Qwen 2.5, Hermes, ...) describe the tools to the model. More template variables (vLLM's
chat_template_kwargs, e.g. Qwen 3's enable_thinking) are passed as keyword arguments.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable
from typing import Any

from protos import generation_pb2
from shared.errors import InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Rendering options a request sets with fields of their own (ChatOptions).
_OWN_FIELDS = ("add_generation_prompt", "continue_final_message", "tools")


def conversation(messages: Iterable[generation_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """The template's messages; an INVALID_ARGUMENT naming the message that cannot be rendered."""
    conv: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}")
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequestError(f"{where}.tool_calls: only assistant messages make tool calls, "
                                          f"this one is {m.role!r}")
            entry["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(m.tool_calls)]
        if m.reasoning:
            if m.role != "assistant":
                raise InvalidRequestError(f"{where}.reasoning: only assistant messages reason, this one is {m.role!r}")
            entry["reasoning_content"] = m.reasoning
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequestError(f"{where}: a tool message needs tool_call_id, the id of the call it answers")
            entry["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id:
            raise InvalidRequestError(f"{where}.tool_call_id: only tool messages answer a call, this one is {m.role!r}")
        conv.append(entry)
    return conv


def template_tools(tools: Iterable[generation_pb2.Tool]) -> list[dict[str, Any]] | None:
    """The tools in apply_chat_template's form; None when there are none (templates test `tools is defined`)."""
    out = []
    for i, tool in enumerate(tools):
        if not tool.name:
            raise InvalidRequestError(f"tools[{i}].name must not be empty")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            function["parameters"] = _json_object(tool.parameters, f"tools[{i}].parameters")
        out.append({"type": "function", "function": function})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise InvalidRequestError(f"tools name {twice!r} more than once: a call could not say which it means")
    return out or None


def template_kwargs(text: str, apply_chat_template: Callable[..., object]) -> dict[str, Any]:
    """The request's extra template variables; a rendering option of apply_chat_template among them is refused (its
    own field sets it, or it would change what the rendering returns). `documents` is a template input: passed."""
    if not text:
        return {}
    kwargs = _json_object(text, "chat_template_kwargs")
    options = {name for name, p in inspect.signature(apply_chat_template).parameters.items()
               if p.kind is not inspect.Parameter.VAR_KEYWORD} - {"documents"}
    for key in sorted(options & kwargs.keys()):
        hint = f": set the request's own {key}" if key in _OWN_FIELDS else ""
        raise InvalidRequestError(f"chat_template_kwargs.{key} is a rendering option, not a template variable{hint}")
    return kwargs


def _tool_call(call: generation_pb2.ToolCall, where: str) -> dict[str, Any]:
    if not call.name:
        raise InvalidRequestError(f"{where}.name must not be empty")
    function = {"name": call.name, "arguments": _json_object(call.arguments or "{}", f"{where}.arguments")}
    return {"id": call.id, "type": "function", "function": function}


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value
