"""Message index <-> output stream entry id."""

from __future__ import annotations

import pytest

from scheduler_service.stream_index import entry_id, index_of, read_cursor


def test_entry_ids_encode_the_index_and_the_cursor_starts_at_it() -> None:
    assert [entry_id(i) for i in range(3)] == ["0-1", "0-2", "0-3"]
    assert [index_of(entry_id(i)) for i in (0, 7, 100000)] == [0, 7, 100000]
    assert index_of(b"0-5") == 4
    # XREAD returns entries strictly after its cursor: the cursor for index k is the entry id of index k - 1.
    assert read_cursor(0) == "0-0" and read_cursor(5) == entry_id(4)


def test_an_entry_id_without_an_index_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'1700000000000-0' does not carry a message index"):
        index_of("1700000000000-0")
