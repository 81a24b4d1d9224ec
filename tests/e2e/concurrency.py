"""Sends many Generate calls at once, as independent clients would."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from llmserve.client import Completion, GenerationClient
from protos import generation_pb2


def generate_all(address: str, requests: list[generation_pb2.GenerateRequest], timeout: float = 600) -> list[Completion]:
    """All requests in flight together; results in request order."""
    with GenerationClient(address) as client, ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [pool.submit(client.generate, r, timeout) for r in requests]
        return [f.result() for f in futures]
