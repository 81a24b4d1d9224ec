"""The soak's load: client threads that send mixed requests back to back and abort some at random times.

Each thread loops until told to stop. A request is greedy, sampled, parallel (n > 1) or best_of, with a
random prompt and output length; about a quarter are ended early by a timer at a random moment (often
before the first token): half by cancelling the client stream, half by the Abort RPC. Every request
ends in one outcome; "failed" and "stuck" are the ones the soak must never see.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from llmserve.client import GenerationClient, make_request
from protos import common_pb2, generation_pb2

# Greedy requests draw their prompt from a fixed pool, so that outputs of the same prompt produced under
# different batches, preemptions and swaps can be compared with each other (see greedy_mismatches).
GREEDY_POOL_SIZE = 12
MAX_PROMPT = 128
MAX_OUTPUT = 96
# Swap preemption of an n > 1 group fails only that request when the CPU pool is full: an expected end.
EXPECTED_ERRORS = ("swap space is full",)

OUTCOMES = ("completed", "cancelled", "aborted", "expected_error", "failed", "stuck")


@dataclass
class Tally:
    """Counts shared by the client threads and the sampler (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    started: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    completion_tokens: int = 0
    failures: list[str] = field(default_factory=list)
    # Greedy pool index -> completed outputs of that prompt.
    greedy_outputs: dict[int, list[list[int]]] = field(default_factory=dict)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {"started": self.started, **{o: self.outcomes[o] for o in OUTCOMES}}


@dataclass(frozen=True)
class Planned:
    """One request and how the client ends it."""

    request: generation_pb2.GenerateRequest
    kind: str
    num_outputs: int
    max_tokens: int
    greedy_index: int | None  # position in the greedy pool
    early_end: str  # "", "cancel" or "abort"
    end_after_s: float


def greedy_pool(vocab_size: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(4, MAX_PROMPT))] for _ in range(GREEDY_POOL_SIZE)]


def plan(rng: random.Random, request_id: str, vocab_size: int, pool: list[list[int]]) -> Planned:
    """A random request: the mix keeps every preemption path busy (recompute for n = 1, swap for forks)."""
    kind = rng.choices(("greedy", "sampled", "parallel", "best_of"), weights=(4, 3, 2, 1))[0]
    max_tokens = rng.randint(1, MAX_OUTPUT)
    sampling: dict[str, object] = dict(max_tokens=max_tokens, ignore_eos=True)
    greedy_index = None
    num_outputs = 1
    if kind == "greedy":
        greedy_index = rng.randrange(len(pool))
        prompt = pool[greedy_index]
        sampling.update(temperature=0.0)
    else:
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, MAX_PROMPT))]
        sampling.update(temperature=rng.choice((0.7, 1.0)), top_p=rng.choice((0.9, 1.0)))
        if rng.random() < 0.5:
            sampling.update(seed=rng.randrange(2**31))
        if kind == "parallel":
            num_outputs = rng.randint(2, 3)
            sampling.update(n=num_outputs)
        elif kind == "best_of":
            num_outputs = rng.randint(1, 2)
            sampling.update(n=num_outputs, best_of=3)
    early_end = rng.choices(("", "cancel", "abort"), weights=(6, 1, 1))[0]
    request = make_request(prompt_token_ids=prompt, request_id=request_id, **sampling)
    return Planned(request, kind, num_outputs, max_tokens, greedy_index, early_end, rng.uniform(0.0, 3.0))


def _end_early(client: GenerationClient, stream: object, planned: Planned, errors: list[str]) -> None:
    """Runs on a timer thread; what goes wrong is kept in `errors` for the request's outcome."""
    if planned.early_end == "cancel":
        stream.cancel()  # type: ignore[attr-defined]
        return
    try:
        client.abort(planned.request.request_id, timeout=10)
    except grpc.RpcError as exc:
        # Not admitted yet, or already finished: the request then runs to its normal end.
        if exc.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
            errors.append(f"Abort: {exc.code().name} {exc.details()}")  # type: ignore[attr-defined]


def run_one(client: GenerationClient, planned: Planned, deadline_s: float) -> tuple[str, int, str, list[list[int]]]:
    """Sends one request and reads its stream to the end: (outcome, completion tokens, detail, outputs)."""
    stream = client.stream(planned.request, timeout=deadline_s)
    timer = None
    timer_errors: list[str] = []
    if planned.early_end:
        timer = threading.Timer(planned.end_after_s, _end_early, (client, stream, planned, timer_errors))
        timer.daemon = True
        timer.start()
    outputs: dict[int, list[int]] = {}
    reasons: dict[int, int] = {}
    last: generation_pb2.GenerateResponse | None = None
    try:
        for msg in stream:
            last = msg
            for delta in msg.outputs:
                outputs.setdefault(delta.index, []).extend(delta.token_ids)
                if delta.finish_reason:
                    reasons[delta.index] = delta.finish_reason
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.CANCELLED and planned.early_end == "cancel":
            return "cancelled", 0, "", []
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "stuck", 0, f"{planned.request.request_id}: no end within {deadline_s:.0f}s", []
        detail = f"{planned.request.request_id}: {code.name} {exc.details()}"  # type: ignore[attr-defined]
        return "failed", 0, detail, []
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
    if timer_errors:
        return "failed", 0, f"{planned.request.request_id}: {timer_errors[0]}", []
    return _classify(planned, last, outputs, reasons)


def _classify(planned: Planned, last: generation_pb2.GenerateResponse | None, outputs: dict[int, list[int]],
              reasons: dict[int, int]) -> tuple[str, int, str, list[list[int]]]:
    rid = planned.request.request_id
    if last is None or not last.HasField("usage"):
        return "failed", 0, f"{rid}: the stream ended without its final message", []
    tokens = last.usage.completion_tokens
    if last.error:
        outcome = "expected_error" if any(e in last.error for e in EXPECTED_ERRORS) else "failed"
        return outcome, tokens, f"{rid}: {last.error}", []
    if common_pb2.FINISH_REASON_ABORT in reasons.values():
        return "aborted", tokens, "", []
    # ignore_eos: every returned sequence must have exactly max_tokens tokens and end by length.
    ok = (sorted(outputs) == list(range(planned.num_outputs))
          and all(len(t) == planned.max_tokens for t in outputs.values())
          and all(reasons.get(i) == common_pb2.FINISH_REASON_LENGTH for i in outputs))
    if not ok:
        lengths = {i: len(t) for i, t in outputs.items()}
        return "failed", tokens, f"{rid} ({planned.kind}): lengths {lengths}, reasons {reasons}", []
    return "completed", tokens, "", [outputs[i] for i in sorted(outputs)]


def client_loop(address: str, thread_no: int, stop: threading.Event, tally: Tally, vocab_size: int,
                pool: list[list[int]], deadline_s: float) -> None:
    """One client: requests back to back until `stop` is set; the request in flight is finished."""
    rng = random.Random(1000 + thread_no)
    with GenerationClient(address) as client:
        i = 0
        while not stop.is_set():
            planned = plan(rng, f"soak-{thread_no}-{i}", vocab_size, pool)
            i += 1
            with tally.lock:
                tally.started += 1
                tally.by_kind[planned.kind] += 1
            try:
                outcome, tokens, detail, outputs = run_one(client, planned, deadline_s)
            except Exception as exc:  # noqa: BLE001 - any surprise is a failed request, reported with the rest
                outcome, tokens, detail, outputs = "failed", 0, f"{planned.request.request_id}: {exc!r}", []
            with tally.lock:
                tally.outcomes[outcome] += 1
                tally.completion_tokens += tokens
                if detail and outcome != "expected_error":
                    tally.failures.append(detail)
                if outcome == "completed" and planned.greedy_index is not None:
                    tally.greedy_outputs.setdefault(planned.greedy_index, []).append(outputs[0])
            if outcome == "stuck":
                time.sleep(0.1)  # do not hammer a wedged server


def greedy_mismatches(outputs: dict[int, list[list[int]]]) -> list[str]:
    """Greedy outputs of one prompt must be prefixes of its longest, whatever batch they ran in."""
    found = []
    for index, runs in sorted(outputs.items()):
        longest = max(runs, key=len)
        for run in runs:
            if longest[: len(run)] != run:
                at = next(k for k, (a, b) in enumerate(zip(run, longest)) if a != b)
                found.append(f"greedy prompt {index}: outputs differ at token {at} ({len(runs)} runs)")
                break
    return found
