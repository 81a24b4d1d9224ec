"""Stream resume and idempotent requests, end to end on a tiny random Llama.

(a) A client reads k messages of a resumable request, drops its call, and resumes from index k:
    the two parts make exactly an uninterrupted run's stream.
(b) The scheduler is SIGKILLed mid-stream and restarted: the client's stream re-attaches by itself
    and ends with exactly the fault-free tokens, each message once.
(c) The same request id twice is one generation with two identical streams; another request under
    the live id is ALREADY_EXISTS; resuming an unknown id is NOT_FOUND.
(d) The same kill under an HTTP client of the OpenAI front: the front re-attaches its call and the
    client's event stream goes on, each token once.
(e) The front's own rolling update: SIGTERM while it streams, and the response still ends whole.
(f) A replica that goes silent without closing its connections: keepalive breaks the stream, which goes on
    from the other replica.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import httpx
import pytest

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import common_pb2, generation_pb2
from tests.e2e.cluster_checks import assert_all_blocks_free, start_standby_scheduler
from worker_service.model_loader import load_config, model_shape
from worker_service.model_runner import eos_token_ids
from worker_service.simulation import simulated_continuation

PROMPT = list(range(400, 460))
T = TypeVar("T")


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "128", "--max-model-len", "512", "--num-threads", "1"],
        http_port=0,
    )
    with LocalCluster(spec) as c:
        yield c


def greedy(request_id: str, max_tokens: int, **extra: object) -> generation_pb2.GenerateRequest:
    return make_request(request_id=request_id, prompt_token_ids=PROMPT, max_tokens=max_tokens, temperature=0.0,
                        ignore_eos=True, **extra)  # type: ignore[arg-type]


def tokens(msgs: list[generation_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for d in m.outputs for t in d.token_ids]


def text(msgs: list[generation_pb2.GenerateResponse]) -> str:
    return "".join(d.text for m in msgs for d in m.outputs)


def assert_one_whole_stream(msgs: list[generation_pb2.GenerateResponse]) -> None:
    """Indexes 0, 1, 2, ... without gap or repeat, and exactly one final message, the last."""
    assert [m.index for m in msgs] == list(range(len(msgs)))
    assert [m.HasField("usage") for m in msgs] == [False] * (len(msgs) - 1) + [True]


def test_a_dropped_resumable_stream_resumes_from_its_index(cluster: LocalCluster) -> None:
    with GenerationClient(cluster.address, resume=None) as client:
        reference = list(client.stream(greedy("resume-ref", 120), timeout=60))
        assert_one_whole_stream(reference)

        request = greedy("resume-a", 120)
        request.resumable = True
        call = client.stream(request, timeout=60)
        k = 5
        head = [next(call) for _ in range(k)]
        call.cancel()  # the connection is gone; a resumable request keeps running
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.CANCELLED

        tail = list(client.resume("resume-a", from_index=k, timeout=60))
        whole = head + tail
        assert_one_whole_stream(whole)
        assert tokens(whole) == tokens(reference) and len(tokens(whole)) == 120
        assert text(whole) == text(reference)
        assert whole[-1].usage == reference[-1].usage
        # While the stream is kept it can be read again from any index, on any replica (only Redis is needed).
        assert list(client.resume("resume-a", from_index=2, timeout=30)) == whole[2:]
        with pytest.raises(grpc.RpcError) as info:
            list(client.resume("resume-a", from_index=len(whole), timeout=30))
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert f"finished with {len(whole)} messages" in info.value.details()
    assert_all_blocks_free(cluster)


def read_across_a_scheduler_kill(cluster: LocalCluster, messages: Callable[[], Iterator[T]], kill_after: int = 5,
                                 graceful: bool = False) -> list[T]:
    """Reads `messages()` on a thread; once `kill_after` have arrived, SIGKILLs the scheduler (SIGTERM when
    `graceful`, waiting for its exit) and restarts it. Returns all that was read: the reading must end without
    an error, and the kill must fall mid-stream."""
    received: list[T] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def read() -> None:
        try:
            for msg in messages():
                received.append(msg)
                if len(received) == kill_after:
                    started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(60), "the stream did not start"
    if graceful:
        cluster.terminate("scheduler")
    else:
        cluster.kill("scheduler")
    at_kill = len(received)
    cluster.restart("scheduler")
    reader.join(120)
    assert not reader.is_alive(), f"the stream did not end ({len(received)} messages)"
    assert not errors, errors
    assert kill_after <= at_kill < len(received), (at_kill, len(received))  # killed mid-stream
    return received


def test_a_resuming_client_survives_a_scheduler_kill(cluster: LocalCluster) -> None:
    max_tokens = 300
    with GenerationClient(cluster.address, resume=None) as plain:
        reference = list(plain.stream(greedy("kill-ref", max_tokens), timeout=120))

    def messages() -> Iterator[generation_pb2.GenerateResponse]:
        # A default client: it re-attaches after UNAVAILABLE. The request is not even resumable: a killed
        # scheduler cannot abort anything, the engine loop of its replacement continues it from Redis.
        with GenerationClient(cluster.address) as client:
            yield from client.stream(greedy("kill-a", max_tokens), timeout=120)

    received = read_across_a_scheduler_kill(cluster, messages)
    assert_one_whole_stream(received)
    assert tokens(received) == tokens(reference) and len(tokens(received)) == max_tokens
    assert text(received) == text(reference)
    assert_all_blocks_free(cluster)


def test_an_http_stream_survives_a_scheduler_kill(cluster: LocalCluster) -> None:
    url = f"{cluster.http_url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    reference = httpx.post(url, json=body, timeout=120).json()["choices"][0]["text"]

    def events() -> Iterator[str]:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    yield line.removeprefix("data: ")

    *chunks, last = read_across_a_scheduler_kill(cluster, events)
    assert last == "[DONE]"
    parsed = [json.loads(c) for c in chunks]
    assert all("choices" in c for c in parsed), [c for c in parsed if "choices" not in c]  # no error event
    assert "".join(c["choices"][0]["text"] for c in parsed) == reference
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"
    assert_all_blocks_free(cluster)


def test_a_stream_outliving_its_schedulers_shutdown_goes_on_with_the_next_one(tiny_llama_dir: Path) -> None:
    # A rolling update: SIGTERM, whose grace period (2 s) a long stream outlives. A simulated worker (modelled
    # H100 steps of ~7 ms, slept) makes the 600 tokens last longer than that whatever this machine's speed.
    config = load_config(str(tiny_llama_dir))
    vocab, eos = model_shape(config).vocab_size, frozenset(eos_token_ids(config, str(tiny_llama_dir)))
    spec = ClusterSpec(model=str(tiny_llama_dir),
                       worker_args=["--simulate", "llama-3-8b-h100", "--seed", "3", "--max-model-len", "1024"])
    with LocalCluster(spec) as cluster:
        def messages() -> Iterator[generation_pb2.GenerateResponse]:
            with GenerationClient(cluster.address) as client:
                yield from client.stream(greedy("rolling", 600), timeout=300)

        received = read_across_a_scheduler_kill(cluster, messages, graceful=True)
        assert_one_whole_stream(received)
        # Not aborted by the replica that went away: the next owner ran it to its end.
        assert received[-1].outputs[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert tokens(received) == simulated_continuation(PROMPT, 600, 3, vocab, eos)
        assert_all_blocks_free(cluster)


def test_a_response_outlives_the_fronts_graceful_stop(tiny_llama_dir: Path) -> None:
    # SIGTERM to the HTTP front mid-stream: it refuses new connections and lets the response finish (its drain
    # timeout, raised here from 30 s for a loaded machine; it was a fixed 5 s). The simulated worker's steps (~7 ms,
    # slept) make 1,200 tokens last longer than 8 s whatever this machine's speed.
    config = load_config(str(tiny_llama_dir))
    vocab, eos = model_shape(config).vocab_size, frozenset(eos_token_ids(config, str(tiny_llama_dir)))
    spec = ClusterSpec(model=str(tiny_llama_dir), http_port=0, http_args=["--drain-timeout", "600"],
                       worker_args=["--simulate", "llama-3-8b-h100", "--seed", "5", "--max-model-len", "2048"])
    with LocalCluster(spec) as cluster:
        body = {"prompt": PROMPT, "max_tokens": 1200, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body, timeout=600) as reply:
            events = (line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: "))
            first = next(events)
            stopped_at = time.monotonic()
            os.kill(cluster.pid("openai"), signal.SIGTERM)
            rest = list(events)
        drained_s = time.monotonic() - stopped_at
        deadline = time.monotonic() + 120
        while not cluster.exited() and time.monotonic() < deadline:  # the front exits once the response ended
            time.sleep(0.05)
        # uvicorn ends a graceful stop by raising the signal again: -15 with its own "Finished" line.
        assert cluster.exited().startswith("the OpenAI front exited with code -15"), cluster.exited()
        assert "Finished server process" in cluster.tail("openai"), cluster.tail("openai")
    assert rest[-1] == "[DONE]", rest[-3:]
    chunks = [json.loads(e) for e in [first, *rest[:-1]]]
    assert all("choices" in c for c in chunks), [c for c in chunks if "choices" not in c]  # no error event
    generated = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert generated == simulated_continuation(PROMPT, 1200, 5, vocab, eos)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert drained_s > 5, drained_s  # longer than the fixed grace period it replaces: the test shows the change


def test_a_stream_from_a_replica_gone_silent_goes_on_from_another(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # A replica whose node is lost sends no FIN or RST (here SIGSTOP: the kernel still holds its connections): a
    # streaming call sends nothing after its request, so its client waited for its deadline. The client's keepalive
    # ping (20 s, 10 s to answer) now breaks it; the stream re-attaches to the other replica, which took the
    # worker's lease meanwhile (10 s TTL) and continued the request.
    config = load_config(str(tiny_llama_dir))
    vocab, eos = model_shape(config).vocab_size, frozenset(eos_token_ids(config, str(tiny_llama_dir)))
    spec = ClusterSpec(model=str(tiny_llama_dir),
                       worker_args=["--simulate", "llama-3-8b-h100", "--seed", "7", "--max-model-len", "1024"])
    with LocalCluster(spec) as cluster:
        standby, standby_address = start_standby_scheduler(cluster, tmp_path / "standby.log")
        primary = cluster.pid("scheduler")
        try:
            received: list[generation_pb2.GenerateResponse] = []
            with GenerationClient(cluster.address, fallback_addresses=[standby_address]) as client:
                for msg in client.stream(greedy("silent", 600), timeout=600):  # far past the keepalive's 30 s
                    received.append(msg)
                    if len(received) == 5:
                        os.kill(primary, signal.SIGSTOP)
        finally:
            os.kill(primary, signal.SIGCONT)
            standby.terminate()
            standby.wait(60)
        assert_one_whole_stream(received)
        assert received[-1].outputs[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert tokens(received) == simulated_continuation(PROMPT, 600, 7, vocab, eos)


def test_the_same_request_twice_is_one_generation_with_two_identical_streams(cluster: LocalCluster) -> None:
    # Unseeded sampling: two generations would differ, so identical streams mean one generation.
    sampled = dict(prompt_token_ids=PROMPT, max_tokens=80, temperature=1.5, ignore_eos=True)
    with GenerationClient(cluster.address) as client:
        first = client.stream(make_request(request_id="idem-1", **sampled), timeout=60)
        head = next(first)  # admitted and live
        second = client.stream(make_request(request_id="idem-1", **sampled), timeout=60)
        one = [head, *first]
        two = list(second)
        assert_one_whole_stream(one)
        assert one == two
        # Sent again after it finished (its stream is kept): the same stream again, nothing generated.
        assert list(client.stream(make_request(request_id="idem-1", **sampled), timeout=60)) == one
        # The sampling really is random: another id with the same request gives other tokens.
        other = list(client.stream(make_request(request_id="idem-2", **sampled), timeout=60))
        assert tokens(other) != tokens(one)

        # An attached reader that goes away does not abort the request its original caller still reads.
        original = client.stream(make_request(request_id="idem-3", **sampled), timeout=60)
        next(original)
        attached = client.stream(make_request(request_id="idem-3", **sampled), timeout=60)
        next(attached)
        attached.cancel()
        rest = list(original)
        assert rest[-1].outputs[0].finish_reason == common_pb2.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 80

        # Another request under a live id is refused.
        live = client.stream(greedy("idem-4", 300), timeout=60)
        next(live)
        with pytest.raises(grpc.RpcError) as info:
            client.generate(greedy("idem-4", 299), timeout=30)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "already in use" in info.value.details()
        live.cancel()
        # Its call cancelled, the request is aborted (Resume waits for its end); sent again, it runs afresh:
        # the caller wants an answer, not the stream that was cut off.
        cut = list(client.resume("idem-4", from_index=0, timeout=60))
        assert cut[-1].outputs[0].finish_reason == common_pb2.FINISH_REASON_ABORT
        again = list(client.stream(greedy("idem-4", 300), timeout=120))
        assert_one_whole_stream(again)
        assert again[-1].outputs[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert again[-1].usage.completion_tokens == 300

        with pytest.raises(grpc.RpcError) as info:
            list(client.resume("never-was", from_index=0, timeout=30))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no request has id 'never-was'" in info.value.details()
    assert_all_blocks_free(cluster)
