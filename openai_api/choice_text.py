"""One chat choice's generated text -> the fields of OpenAI's message (whole) or delta (streamed): the reasoning
(with the front's reasoning parser), the content, and the tool calls (with a tool_choice that calls tools).

The reasoning is split off first; tool calls are read from what is left. Both are read as the text arrives, so a
stream and a whole response carry the same fields. The reasoning goes out under vLLM's `reasoning` and DeepSeek's
`reasoning_content` (clients read one or the other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openai_api.protocol import ChatCompletionRequest
from openai_api.reasoning import ReasoningSplitter
from openai_api.tools import ToolCallMode, ToolCallReader
from protos import generation_pb2


class ChoiceText:
    """Reads one choice's text. `mode`: its tool calling (None: none); `reasoning_parser`: the front's (None: the
    text has no reasoning to split off); `include_reasoning` false drops the reasoning (vLLM's request field)."""

    def __init__(self, mode: ToolCallMode | None, reasoning_parser: str | None, include_reasoning: bool,
                 constrained: bool = False) -> None:
        self._tools = ToolCallReader(mode) if mode is not None else None
        self._reasoning = (ReasoningSplitter(reasoning_parser, constrained) if reasoning_parser is not None
                           else None)
        self._include_reasoning = include_reasoning

    @property
    def plain(self) -> bool:
        """Whether the text is all content (no reasoning parser, no tool calls)."""
        return self._tools is None and self._reasoning is None

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields a stream sends for `text` (`final`: the choice's last); empty while it is held back."""
        if self.plain:
            return {"content": text} if text else {}
        reasoning, content = self._split(text, final)
        out: dict[str, Any] = self._reasoning_fields(reasoning) if reasoning else {}
        calls: list[dict[str, Any]] = []
        if self._tools is not None:
            parts = self._tools.read(content, final)
            content, calls = parts.content, parts.tool_calls
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The message fields of the whole text (after `role`)."""
        if self.plain:
            return {"content": text}
        reasoning, content = self._split(text, final=True)
        out: dict[str, Any] = {}
        if self._tools is not None:
            content = self._tools.read(content, final=True).content
            out["tool_calls"] = self._tools.calls
        out = {"content": content or None, **out}
        if self._reasoning is not None:
            out.update(self._reasoning_fields(reasoning or None))
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a stop after a call."""
        return self._tools.finish_reason(reason) if self._tools is not None else reason

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self._reasoning is None:
            return "", text
        split = self._reasoning.read(text, final)
        return split.reasoning, split.content

    def _reasoning_fields(self, reasoning: str | None) -> dict[str, Any]:
        if not self._include_reasoning:
            return {}
        return {"reasoning": reasoning, "reasoning_content": reasoning}


@dataclass(frozen=True)
class OutputParsers:
    """The front's readers of generated text: tool calls in the model's syntax (tool_choice "auto") and reasoning."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


NO_PARSERS = OutputParsers()

def choice_reader(req: ChatCompletionRequest, mode: ToolCallMode | None, generate: generation_pb2.GenerateRequest,
                  reasoning_parser: str | None) -> Callable[[], ChoiceText]:
    """Makes each choice's reader, for the request as sent (`generate`). A constrained output (structured outputs,
    tool_choice "required" or a named function) follows its grammar from the first token: it holds reasoning only
    where the grammar let it open a `<think>` (ReasoningSplitter)."""
    constrained = generate.sampling.HasField("structured_outputs")
    return lambda: ChoiceText(mode, reasoning_parser, req.include_reasoning, constrained)
