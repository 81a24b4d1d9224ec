"""Fixtures of the integration tests that talk to a real redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis


@pytest.fixture()
def url(redis_server) -> str:
    """URL of a fresh redis-server (the `redis_server` fixture of tests/conftest.py)."""
    return redis_server.url


@pytest.fixture()
def plain(url: str) -> Iterator[redis.Redis]:
    """A plain synchronous client to inspect what the store wrote."""
    client = redis.Redis.from_url(url, decode_responses=True)
    yield client
    client.close()
