"""One way to open a Redis client, for every service that talks to the state store.

Blocking reads (XREAD / BLPOP) wait up to a few seconds, so the socket timeout must exceed them;
a connection that cannot be made within a few seconds is reported rather than waited on.
"""

from __future__ import annotations

import redis.asyncio as aioredis

# Longest any single Redis command may take, blocking reads included.
SOCKET_TIMEOUT_SECONDS = 30.0
CONNECT_TIMEOUT_SECONDS = 5.0


def connect(url: str, max_connections: int = 1024) -> aioredis.Redis:
    """An asyncio Redis client for `url` (redis://host:port/db); connects lazily on first use."""
    return aioredis.Redis.from_url(
        url, max_connections=max_connections, health_check_interval=30,
        socket_timeout=SOCKET_TIMEOUT_SECONDS, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
    )
