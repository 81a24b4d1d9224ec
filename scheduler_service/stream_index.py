"""Message index <-> Redis stream entry id, for a request's output stream.

Every committed GenerateResponse is appended under an explicit entry id that encodes its position,
so any replica can serve "the messages from index k on" with one XREAD and no counting:

    message index:   0      1      2      3    ...
    entry id:       0-1    0-2    0-3    0-4   ...   (0-0 is not a valid stream id)
    XREAD after:    0-0    0-1    0-2    0-3   ...   ("after 0-k" starts at index k)

The stream is append-only (never trimmed; it expires whole), so index = entry sequence - 1 holds
for its whole life, whichever engine loop appended each message.
"""

from __future__ import annotations


def entry_id(index: int) -> str:
    """The stream entry id of the message at `index`."""
    return f"0-{index + 1}"


def read_cursor(from_index: int) -> str:
    """The XREAD cursor ("entries after this id") whose first entry is the message at `from_index`."""
    return f"0-{from_index}"


def index_of(entry: str | bytes) -> int:
    """The message index of a stream entry id written by `entry_id`."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    ms, _, seq = text.partition("-")
    if ms != "0" or not seq:
        raise ValueError(f"stream entry id {text!r} does not carry a message index (expected 0-<index + 1>)")
    return int(seq) - 1
