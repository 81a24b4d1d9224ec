"""Tool calls written in a model's own syntax, read from its free text (tool_choice "auto"; vLLM's
--tool-call-parser). Each parser takes the text as it grows and splits it into content and complete calls:
a call is handed out once its text is whole, and text that may still become a call is held back until it
is known not to. Text that looked like a call but does not parse is handed back as content: nothing is lost.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, anywhere in the text (Hermes 2/3,
  Qwen 2.5 and many others' chat templates ask for these tags).
- llama3_json: an answer that is a call starts with `{"name": ..., "parameters": {...}}` (or
  `<|python_tag|>` before it); several are separated by `;` (Llama 3.1 / 3.2's JSON tool calling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shared.text_tails import prefix_tail_length

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_JSON = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


@dataclass
class Parsed:
    """What a piece of text turned out to be: content for the client, and (name, arguments JSON) calls."""

    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)


def calls_of(value: Any) -> list[tuple[str, str]] | None:
    """The calls a decoded JSON value holds ({"name", "arguments" or "parameters"}, or a list of them); None when it
    is not calls."""
    values = value if isinstance(value, list) else [value]
    calls = []
    for item in values:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        # How much of an open block's text has been searched for the end tag: each piece of a long call is
        # searched once, not the whole block again.
        self._searched = 0

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while True:
            if not self._in_call:
                start = self._buffer.find(self.START)
                if start < 0:
                    keep = prefix_tail_length(self._buffer, (self.START,))
                    out.content += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._buffer[:start]
                self._buffer, self._in_call, self._searched = self._buffer[start + len(self.START):], True, 0
            end = self._buffer.find(self.END, max(0, self._searched - len(self.END) + 1))
            if end < 0:
                self._searched = len(self._buffer)
                return out
            self._take_block(self._buffer[:end], out, closed=True)
            self._buffer, self._in_call = self._buffer[end + len(self.END):], False

    def finish(self) -> Parsed:
        """The held-back rest: a tag's beginning as content, a block never closed as its call if it parses."""
        out = Parsed()
        if self._in_call:
            self._take_block(self._buffer, out, closed=False)
        else:
            out.content = self._buffer
        self._buffer, self._in_call = "", False
        return out

    def _take_block(self, block: str, out: Parsed, closed: bool) -> None:
        try:
            calls = calls_of(json.loads(block))
        except ValueError:
            calls = None
        if calls is None:
            out.content += self.START + block + (self.END if closed else "")
        else:
            out.calls += calls


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "content" or "calls"
        self._pos = 0

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        if self._mode == "calls" and "}" not in text:
            return Parsed()  # a call completes only at a closing brace: a long one is not parsed again per piece
        if self._mode is None:
            head = self._buffer.lstrip(_WHITESPACE)
            if not head or self.TAG.startswith(head):
                return Parsed()  # not yet known
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip(_WHITESPACE)
                if not head:
                    return Parsed()
            self._mode = "calls" if head.startswith("{") else "content"
            if self._mode == "calls":
                self._pos = self._buffer.index("{")
        if self._mode == "content":
            out, self._buffer = Parsed(self._buffer), ""
            return out
        return self._complete_calls()

    def finish(self) -> Parsed:
        """Text that is no complete call (an object cut short) as content."""
        rest = self._buffer[self._pos:].lstrip(_WHITESPACE + ";") if self._mode == "calls" else self._buffer
        self._buffer, self._pos = "", 0
        return Parsed(rest if rest.strip(_WHITESPACE + ";") else "")

    def _complete_calls(self) -> Parsed:
        out = Parsed()
        while (whole := next_json_value(self._buffer, self._pos, ";")) is not None:
            calls = calls_of(whole[0])
            if calls is None:
                break  # not a call: finish() hands it back as content
            out.calls += calls
            self._pos = whole[1]
        return out


def next_json_value(text: str, pos: int, separators: str) -> tuple[Any, int] | None:
    """The JSON value that `text` holds whole from `pos` on, past whitespace and `separators`, and where it ends;
    None while it is not whole (or there is none)."""
    while pos < len(text) and text[pos] in _WHITESPACE + separators:
        pos += 1
    try:
        return _JSON.raw_decode(text, pos)
    except ValueError:
        return None


def make_parser(name: str) -> HermesParser | Llama3JsonParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"tool call parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
