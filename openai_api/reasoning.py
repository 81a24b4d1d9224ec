"""A reasoning model's thinking, split from its answer (vLLM's --reasoning-parser): the text between `<think>` and
`</think>` is the reasoning, the rest the content. The split is made as the text grows; a piece of text that may
still turn out to be a tag is held back until it is known, so a stream and a whole response split alike.

- deepseek_r1: the output starts inside the thinking (DeepSeek R1's chat template opens `<think>` in the prompt);
  a `<think>` the model writes first is dropped; everything up to `</think>` is reasoning, and an output that
  never closes it is all reasoning.
- qwen3: thinking only where the output opens with `<think>` (Qwen 3, QwQ; with enable_thinking false the
  template leaves none and the output is all content); reasoning up to `</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.text_tails import prefix_tail_length

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"
_WHITESPACE = " \t\n\r"


@dataclass
class Split:
    """A piece of a choice's text: what is reasoning, what is content."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits one choice's text into reasoning and content as it arrives. `constrained`: the output follows a grammar
    from its first token (structured outputs), so it is not inside a thinking it did not open, whatever the parser
    assumes; it holds reasoning only where the grammar let it write `<think>` first."""

    def __init__(self, parser: str, constrained: bool = False) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        self._inside_first = parser == "deepseek_r1" and not constrained
        self._state = "start"  # start (an opening tag may come), reasoning, content
        self._buffer = ""

    def read(self, text: str, final: bool) -> Split:
        """The split of `text`; `final`: it is the choice's last, and whatever was held back goes out."""
        self._buffer += text
        out = Split()
        if self._state == "start":
            head = self._buffer.lstrip(_WHITESPACE)
            if head.startswith(START):
                self._buffer, self._state = head[len(START):], "reasoning"
            elif START.startswith(head) and not final:
                return out  # not known yet ("", "<th", ...)
            else:
                self._state = "reasoning" if self._inside_first else "content"
        if self._state == "reasoning":
            end = self._buffer.find(END)
            if end < 0:
                cut = len(self._buffer) - (0 if final else prefix_tail_length(self._buffer, (END,)))
                out.reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return out
            out.reasoning, self._buffer, self._state = self._buffer[:end], self._buffer[end + len(END):], "content"
        out.content, self._buffer = self._buffer, ""
        return out
