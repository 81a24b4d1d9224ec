"""Pure logic of the llama.cpp comparison: stream token counting, server command lines, the report's ratios, the
single-stream rounds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks.dataset import BenchRequest
from benchmarks.llamacpp_build import cmake_configure_args
from benchmarks.llamacpp_server import LlamaServer, LlamaServerDied, LlamaServerSpec, slot_context
from benchmarks.metrics import RequestTiming
from benchmarks.openai_driver import OpenAITarget, StreamTally, completion_body, sse_data
from benchmarks.report_llamacpp import ratios_table, unmeasured_q4
from benchmarks.single_stream import TimestampStreamer, interleaved

REQ = BenchRequest(prompt_token_ids=[101, 102, 103], output_len=3)


def _llama_chunk(text: str, predicted_n: int) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}], "timings": {"predicted_n": predicted_n}}


def test_llama_server_counts_come_from_its_running_total() -> None:
    # The second token ended inside a UTF-8 character: no chunk for it, the third chunk brings two tokens.
    tally = StreamTally()
    counts = [tally.add(_llama_chunk("a", 1)), tally.add(_llama_chunk("é", 3))]
    final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "timings": {"predicted_n": 3},
             "usage": {"completion_tokens": 3, "prompt_tokens": 3}}
    counts.append(tally.add(final))
    assert counts == [1, 2, 0]
    assert tally.check(REQ) == ""


def test_vllm_style_counts_come_from_logprobs_tokens() -> None:
    tally = StreamTally()
    two = {"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}, "finish_reason": None}]}
    one = {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["\ufffd"]}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 3}}
    assert [tally.add(two), tally.add(one), tally.add(usage)] == [2, 1, 0]
    assert tally.check(REQ) == ""


def test_a_chunk_with_text_and_no_count_is_refused() -> None:
    with pytest.raises(ValueError, match="no token count"):
        StreamTally().add({"choices": [{"index": 0, "text": "a"}]})


def test_an_error_event_is_refused() -> None:
    with pytest.raises(ValueError, match="server error"):
        StreamTally().add({"error": {"message": "boom"}})


@pytest.mark.parametrize(("tokens", "usage", "prompt", "reason"), [
    (3, None, 3, "no usage"),
    (2, 3, 3, "usage says 3"),
    (2, 2, 3, "3 asked"),
    (3, 3, 4, "4 prompt tokens"),
])
def test_check_names_what_does_not_match(tokens: int, usage: int | None, prompt: int, reason: str) -> None:
    tally = StreamTally(tokens=tokens, usage_completion_tokens=usage, usage_prompt_tokens=prompt)
    assert reason in tally.check(REQ)


def test_request_body_sends_token_ids_greedy_ignore_eos_and_the_servers_counting_field() -> None:
    body = completion_body(REQ, OpenAITarget.llama_server("http://h:1"))
    assert body["prompt"] == [101, 102, 103] and body["max_tokens"] == 3
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["stream"] is True
    assert body["timings_per_token"] is True and "logprobs" not in body
    assert completion_body(REQ, OpenAITarget.vllm_style("http://h:1"))["logprobs"] == 0


def test_sse_data_lines() -> None:
    assert sse_data('data: {"a":1}') == '{"a":1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    assert sse_data("") is None and sse_data(": keep-alive") is None and sse_data("event: x") is None


def test_llama_server_command_gives_every_slot_its_context() -> None:
    spec = LlamaServerSpec(Path("/b/llama-server"), Path("/m.gguf"), parallel=16, slot_context=385, threads=2)
    cmd = spec.command(8080)
    assert cmd[0] == "/b/llama-server"
    assert cmd[cmd.index("--parallel") + 1] == "16"
    assert cmd[cmd.index("--ctx-size") + 1] == str(16 * 385)
    assert cmd[cmd.index("--threads") + 1] == "2" and cmd[cmd.index("--threads-batch") + 1] == "2"
    assert slot_context(256, 128) == 385


def test_llama_server_spec_validates() -> None:
    with pytest.raises(ValueError, match="parallel"):
        LlamaServerSpec(Path("s"), Path("m"), parallel=0, slot_context=10, threads=1)


def test_build_is_release_native_and_fetches_nothing() -> None:
    args = cmake_configure_args(Path("/src"), Path("/build"))
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_BUILD_UI=OFF"):
        assert flag in args


def test_ratios_table_judges_each_ratio_by_its_direction() -> None:
    lines = ratios_table({"output_tok_s_vs_llamacpp_f32": {"llmserve (gRPC)": 0.9},
                          "tpot_vs_llamacpp_f32": {"llmserve (gRPC)": 1.2},
                          "tpot_vs_hf_generate": {"llmserve (gRPC)": 0.8}})
    assert len(lines) == 5
    assert "not met (at least 1x)" in lines[2]
    assert "| met (at most 1.25x)" in lines[3]
    assert "not met (at most 0.7x)" in lines[4]


def test_timestamp_streamer_skips_the_prompt() -> None:
    streamer = TimestampStreamer()
    streamer.put(torch.tensor([[1, 2, 3]]))
    streamer.put(torch.tensor([4]))
    streamer.put(torch.tensor([5]))
    streamer.end()
    assert len(streamer.token_times) == 2
    assert streamer.token_times[0] <= streamer.token_times[1]


def test_a_llama_server_killed_by_a_signal_is_reported_by_the_signals_name(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho starting\nkill -ILL $$\n")
    binary.chmod(0o755)
    spec = LlamaServerSpec(binary, tmp_path / "m.gguf", parallel=1, slot_context=10, threads=1)
    with pytest.raises(LlamaServerDied, match="starting") as died:
        with LlamaServer(spec):
            pass
    assert died.value.reason == "llama-server exited with signal SIGILL"


def test_the_report_says_why_the_q4_rows_are_missing() -> None:
    assert unmeasured_q4({"q4_gguf": "m.Q4_1.gguf"}) == []
    lines = unmeasured_q4({"q4_gguf": "m.Q4_1.gguf", "q4_error": "llama-server exited with signal SIGILL"})
    assert lines[-1] == "llama.cpp on `m.Q4_1.gguf` was not measured on this machine: llama-server exited with signal SIGILL."


def test_single_stream_rounds_take_every_backend_in_a_rotated_order() -> None:
    calls: list[tuple[str, int]] = []

    def backend(name: str) -> Callable[[BenchRequest], RequestTiming]:
        def one(req: BenchRequest) -> RequestTiming:
            calls.append((name, req.output_len))
            return RequestTiming(prompt_len=len(req.prompt_token_ids), sent=float(len(calls)))
        return one

    requests = [BenchRequest(prompt_token_ids=[1], output_len=n) for n in (10, 20, 30, 40)]
    timings = interleaved({name: backend(name) for name in "abc"}, requests)
    # Each round sends one request through all three; the first backend of a round moves one place each round.
    assert calls == [("a", 10), ("b", 10), ("c", 10), ("b", 20), ("c", 20), ("a", 20),
                     ("c", 30), ("a", 30), ("b", 30), ("a", 40), ("b", 40), ("c", 40)]
    assert {name: [t.sent for t in runs] for name, runs in timings.items()} == {
        "a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}
