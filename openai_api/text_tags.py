"""Tags in generated text (a tool call's, a reasoning block's) found as the text grows."""

from __future__ import annotations


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`: text that may yet become the tag, held back."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
