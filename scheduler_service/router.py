"""Chooses the worker that serves a new request."""

from __future__ import annotations

import zlib


class Router:
    """Spreads requests over workers by a stable hash of the request id.

    Stable hashing keeps a retried request id on the same worker. Load-aware
    and prefix-aware routing need the workers' load from Redis and come with
    multi-worker scaling.
    """

    def __init__(self, worker_ids: list[str]) -> None:
        if not worker_ids:
            raise ValueError("the router needs at least one worker")
        self._workers = list(worker_ids)

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def pick(self, request_id: str) -> str:
        """The worker id for a request."""
        return self._workers[zlib.crc32(request_id.encode()) % len(self._workers)]
