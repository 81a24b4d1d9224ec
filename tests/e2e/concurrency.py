"""Sends many Generate calls at once, as independent clients would."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from llmserve.client import Completion, GenerationClient, collect_completions
from protos import common_pb2, generation_pb2


def generate_all(address: str, requests: list[generation_pb2.GenerateRequest], timeout: float = 600) -> list[Completion]:
    """All requests in flight together; results in request order."""
    with GenerationClient(address) as client, ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [pool.submit(client.generate, r, timeout) for r in requests]
        return [f.result() for f in futures]


class Streams:
    """Requests streamed in background threads, observable while they run.

    `tokens[i]` / `finish[i]` follow request i's first sequence as it streams; `wait_started` returns once
    every request has received a token (so each is admitted and prefilled: whatever is sent next arrives
    later, which fixes the scheduler's FCFS order and so its choice of whom to preempt); `join` returns
    the Completions of each request, in request order.
    """

    def __init__(self, client: GenerationClient, requests: list[generation_pb2.GenerateRequest],
                 timeout_s: float = 120) -> None:
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.finish: list[str] = ["" for _ in requests]
        self.errors: list[BaseException] = []
        self._results: list[list[Completion]] = [[] for _ in requests]
        self._first = [threading.Event() for _ in requests]
        self._got_token = [False for _ in requests]
        self._threads = [threading.Thread(target=self._run, args=(client, i, r, timeout_s), daemon=True)
                         for i, r in enumerate(requests)]
        for t in self._threads:
            t.start()

    def _run(self, client: GenerationClient, i: int, request: generation_pb2.GenerateRequest,
             timeout_s: float) -> None:
        try:
            self._results[i] = collect_completions(self._observe(i, client.stream(request, timeout=timeout_s)))
        except BaseException as exc:  # noqa: BLE001 - reported by wait_started() and join()
            self.errors.append(exc)
        finally:
            self._first[i].set()

    def _observe(self, i: int, messages: Iterable[generation_pb2.GenerateResponse]
                 ) -> Iterator[generation_pb2.GenerateResponse]:
        for msg in messages:
            for delta in msg.outputs:
                if delta.index == 0:
                    self.tokens[i].extend(delta.token_ids)
                    if delta.finish_reason:
                        self.finish[i] = common_pb2.FinishReason.Name(delta.finish_reason)
                if delta.token_ids:
                    self._got_token[i] = True
                    self._first[i].set()
            yield msg

    def wait_started(self, timeout_s: float) -> None:
        for event in self._first:
            assert event.wait(timeout_s), "generation did not start"
        assert not self.errors, self.errors
        # A stream that ended without a token (an in-band error) also sets its event.
        assert all(self._got_token), "a request ended without a token"

    def join(self, timeout_s: float) -> list[list[Completion]]:
        for t in self._threads:
            t.join(timeout_s)
            assert not t.is_alive(), "a request did not complete"
        assert not self.errors, self.errors
        return self._results
