"""The asyncio Redis client packs commands in C (hiredis) byte for byte as redis-py's Python packer does."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from shared.redis_client import connect

COMMANDS = [
    ("SET", "key", "välue"),
    (b"HSET", b"h", "field", 7, "cum", 0.1, "neg", -2.5e-07, "big", 10**20),
    ("CONFIG GET", "maxmemory"),
    (b"CLIENT SETNAME", b"replica"),
    ("EVALSHA", "0" * 40, 2, "k1", "k2", *(b"x" * n for n in range(0, 300, 7))),
    ("SET", "big", b"y" * 10_000),
    ("SET", "view", memoryview(b"bytes through redis-py's own packer")),
]


def _python_packing(args: tuple[object, ...]) -> bytes:
    return b"".join(bytes(chunk) for chunk in Connection().pack_command(*args))


@pytest.fixture(params=["redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "unix:///tmp/no-such-redis.sock"])
def connection(request: pytest.FixtureRequest) -> Connection:
    """A connection of each kind a URL can ask for (TCP, TLS, unix socket), not connected."""
    return connect(request.param).connection_pool.make_connection()


def test_commands_pack_as_redis_py_packs_them(connection: Connection) -> None:
    assert type(connection).__name__.startswith("PackedInC")
    for args in COMMANDS:
        assert b"".join(bytes(c) for c in connection.pack_command(*args)) == _python_packing(args), args


def test_a_pipeline_packs_as_its_commands_one_after_another(connection: Connection) -> None:
    packed = b"".join(bytes(c) for c in connection.pack_commands(COMMANDS))
    assert packed == b"".join(_python_packing(args) for args in COMMANDS)


def test_a_value_redis_cannot_take_is_a_data_error(connection: Connection) -> None:
    with pytest.raises(DataError, match="bool"):
        connection.pack_command("SET", "flag", True)
