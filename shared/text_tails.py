"""Text that may yet become a given string: a stop string in the scheduler's output streams, a tag (a tool call's,
a reasoning block's) in the OpenAI front's readers. Such a tail is held back until later text shows what it is."""

from __future__ import annotations

from collections.abc import Sequence


def prefix_tail_length(text: str, strings: Sequence[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `strings` (never more than the
    longest string's length - 1: vLLM's fixed hold-back); 0 when no tail can become one."""
    longest = min(max(len(s) for s in strings) - 1, len(text))
    for tail in range(longest, 0, -1):
        suffix = text[-tail:]
        if any(len(s) > tail and s.startswith(suffix) for s in strings):
            return tail
    return 0
