"""A Redis database as plain data: every key with its type, value and expiry, for comparing two states."""

from __future__ import annotations

import redis


def redis_state(client: redis.Redis) -> dict[bytes, tuple[bytes, object, bool]]:
    """Every key: its type, value (sorted where Redis has no order; streams with their entry ids), whether it expires."""
    state: dict[bytes, tuple[bytes, object, bool]] = {}
    for key in sorted(client.scan_iter(count=1000)):
        kind = client.type(key)
        if kind == b"string":
            value: object = client.get(key)
        elif kind == b"list":
            value = client.lrange(key, 0, -1)
        elif kind == b"hash":
            value = sorted(client.hgetall(key).items())
        elif kind == b"set":
            value = sorted(client.smembers(key))
        elif kind == b"stream":
            value = [(i, sorted(f.items())) for i, f in client.xrange(key)]
        else:
            raise ValueError(f"unexpected type {kind!r} of {key!r}")
        state[key] = (kind, value, client.ttl(key) > 0)
    return state
