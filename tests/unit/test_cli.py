"""The command line: flags, environment-variable defaults, what `up` forwards to each service."""

from __future__ import annotations

import socket

import pytest

from llmserve.cli import (
    _SCHEDULER_PASS,
    _WORKER_PASS,
    _passthrough,
    bad_env_values,
    build_parser,
    main,
    unknown_env_names,
)


def test_every_command_is_there() -> None:
    parser = build_parser()
    for command in ("up", "demo", "worker", "scheduler", "generate", "prepare-model"):
        assert parser.parse_args([command] + (["--redis-url", "redis://x"] if command == "scheduler" else []))


def test_flags_use_vllm_names() -> None:
    args = build_parser().parse_args([
        "scheduler", "--redis-url", "redis://r:6379/0", "--lease-ttl", "4",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "256",
        "--enable-chunked-prefill", "--enable-prefix-caching",
    ])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len) == (8, 128, 256)
    assert args.lease_ttl == 4 and args.enable_chunked_prefill and args.enable_prefix_caching


def test_a_worker_registers_under_its_advertised_address() -> None:
    args = build_parser().parse_args([
        "worker", "--redis-url", "redis://r:6379/0", "--advertise-address", "worker-0.worker:50061",
        "--drain-timeout", "12", "--heartbeat-ttl", "3",
    ])
    assert (args.redis_url, args.advertise_address, args.drain_timeout, args.heartbeat_ttl) == (
        "redis://r:6379/0", "worker-0.worker:50061", 12, 3)


def test_environment_variables_give_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVE_REDIS_URL", "redis://env:6379/0")
    monkeypatch.setenv("LLMSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("LLMSERVE_LEASE_TTL", "2.5")
    monkeypatch.setenv("LLMSERVE_ENABLE_PREFIX_CACHING", "true")
    args = build_parser().parse_args(["scheduler"])
    assert args.redis_url == "redis://env:6379/0" and args.max_num_seqs == 7
    assert args.lease_ttl == 2.5 and args.enable_prefix_caching is True
    assert build_parser().parse_args(["scheduler", "--max-num-seqs", "3"]).max_num_seqs == 3


def test_up_forwards_each_flag_to_its_service() -> None:
    args = build_parser().parse_args([
        "up", "--num-gpu-blocks-override", "64", "--swap-space", "0.5", "--enable-chunked-prefill",
        "--max-num-seqs", "4", "--max-model-len", "512", "--gpu-memory-utilization", "0.8",
        "--output-retention", "300",
    ])
    worker = _passthrough(args, _WORKER_PASS)
    scheduler = _passthrough(args, _SCHEDULER_PASS)
    assert worker[worker.index("--num-gpu-blocks-override") + 1] == "64"
    assert worker[worker.index("--swap-space") + 1] == "0.5"
    assert worker[worker.index("--gpu-memory-utilization") + 1] == "0.8"
    assert "--enable-chunked-prefill" in scheduler and "--enable-prefix-caching" not in scheduler
    assert scheduler[scheduler.index("--max-num-seqs") + 1] == "4"
    assert scheduler[scheduler.index("--output-retention") + 1] == "300"
    assert "--max-model-len" in worker and "--max-model-len" in scheduler


def test_chunked_prefill_is_on_off_or_left_to_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the scheduler decides by the worker's device; either choice reaches the service from `up` and the env."""
    parse = build_parser().parse_args
    scheduler = ["scheduler", "--redis-url", "redis://r:6379/0"]
    assert parse(scheduler).enable_chunked_prefill is None
    assert parse([*scheduler, "--enable-chunked-prefill"]).enable_chunked_prefill is True
    assert parse([*scheduler, "--no-enable-chunked-prefill"]).enable_chunked_prefill is False
    scheduler_flags = {choice: _passthrough(parse(["up", *flag]), _SCHEDULER_PASS) for choice, flag in
                       ((None, []), (True, ["--enable-chunked-prefill"]), (False, ["--no-enable-chunked-prefill"]))}
    assert not any("chunked" in f for f in scheduler_flags[None])
    assert "--enable-chunked-prefill" in scheduler_flags[True]
    assert "--no-enable-chunked-prefill" in scheduler_flags[False]
    monkeypatch.setenv("LLMSERVE_ENABLE_CHUNKED_PREFILL", "false")
    assert build_parser().parse_args(scheduler).enable_chunked_prefill is False


def test_bench_hands_its_arguments_to_the_serving_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: llmserve bench") and "--address" in usage and "--num-requests" in usage


def test_generate_fails_fast_with_the_address_when_no_scheduler_listens(capsys: pytest.CaptureFixture[str]) -> None:
    # A bound socket that does not listen: connections to it are refused at once.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        rc = main(["generate", "--address", address, "--prompt", "hi", "--connect-timeout", "0.5", "--timeout", "600"])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"no scheduler accepted a connection at {address} within 0.5 s" in err and "--tls-ca-file" in err


@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_start_timeout_that_is_not_positive_is_refused(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args([command]).start_timeout == 900  # a first start compiles the kernels: minutes
    assert main([command, "--start-timeout", "0"]) == 2
    assert f"llmserve {command}: error: {command}: --start-timeout must be positive, got 0.0" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["up", "--port", "99999"], ["worker", "--metrics-port", "-1"],
                                   ["up", "--http-port", "65536"], ["openai", "--port", "http"]])
def test_a_port_outside_0_to_65535_is_refused(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """gRPC would keep a larger port's low 16 bits: `up --port 99999` served on 34463 while it said 99999."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(flags)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"llmserve {flags[0]}: error: argument {flags[1]}: " in err
    assert ("must be in 0..65535" if flags[2].lstrip("-").isdigit() else "not a port number: 'http'") in err
    assert getattr(build_parser().parse_args([flags[0], flags[1], "65535"]), flags[1][2:].replace("-", "_")) == 65535


@pytest.mark.parametrize(("command", "variable", "value", "reason"), [
    ("scheduler", "LLMSERVE_MAX_NUM_SEQS", "abc", "not a valid int"),
    ("scheduler", "LLMSERVE_PORT", "99999", "must be in 0..65535, got 99999"),
    ("worker", "LLMSERVE_BLOCK_SIZE", "7", "expected one of 8, 16, 32"),
    ("scheduler", "LLMSERVE_ENABLE_PREFIX_CACHING", "ture", "expected 1/true/yes or 0/false/no (or empty)"),
])
def test_a_bad_environment_value_is_refused_by_the_command_that_reads_it(
        command: str, variable: str, value: str, reason: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A Kubernetes ConfigMap's typo ends the command with the variable named (exit 2, as a bad flag does), not a
    traceback; a command without that flag is not concerned, and the flag given on the command line wins."""
    monkeypatch.setenv(variable, value)
    assert main([command, "--redis-url", "redis://127.0.0.1:1"]) == 2
    assert f"llmserve {command}: error: {variable}='{value}': {reason}" in capsys.readouterr().err
    assert bad_env_values(build_parser().parse_args(["generate"])) == []
    flag = "--" + variable.removeprefix("LLMSERVE_").lower().replace("_", "-")
    given = ["--enable-prefix-caching"] if flag == "--enable-prefix-caching" else [flag, "16"]
    assert bad_env_values(build_parser().parse_args([command, "--redis-url", "redis://x", *given])) == []


def test_environment_values_are_converted_and_checked_item_by_item(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVE_STOP", "a,b")
    monkeypatch.setenv("LLMSERVE_DTYPE", "bfloat16")
    monkeypatch.setenv("LLMSERVE_ENABLE_CHUNKED_PREFILL", "")
    assert build_parser().parse_args(["generate"]).stop == ["a", "b"]
    args = build_parser().parse_args(["up"])
    assert args.dtype == "bfloat16" and args.enable_chunked_prefill is False


@pytest.mark.parametrize("flags", [[], ["--prompt", "hi", "--chat", "hi"]])
def test_generate_needs_exactly_one_of_prompt_and_chat(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--address", "127.0.0.1:1", *flags]) == 2  # before any connection
    assert "llmserve generate: error: give --prompt or --chat (one of them)" in capsys.readouterr().err


def test_a_variable_no_flag_reads_is_named_with_the_likeliest_meant_one() -> None:
    environ = {
        "LLMSERVE_MAX_NUM_SEQ": "8",  # a ConfigMap typo: --max-num-seqs stays at its default
        "LLMSERVE_COLOUR": "blue",  # nothing like it
        "LLMSERVE_DEVICE": "cpu",  # a worker's flag: one ConfigMap may serve every command
        "LLMSERVE_CACHE": "/cache",  # not a flag, read by the model preparation
        "LLMSERVE_AUTH_TOKEN": "t",  # a secret kept out of argv
        "OTHER_MAX_NUM_SEQ": "1",
    }
    assert unknown_env_names(build_parser(), environ) == [
        "LLMSERVE_COLOUR is set but no llmserve flag reads it; it is ignored",
        "LLMSERVE_MAX_NUM_SEQ is set but no llmserve flag reads it (did you mean LLMSERVE_MAX_NUM_SEQS?); it is ignored",
    ]


def test_every_command_warns_of_an_unknown_variable_and_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LLMSERVE_REDISURL", "redis://elsewhere")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        rc = main(["generate", "--address", f"127.0.0.1:{taken.getsockname()[1]}", "--prompt", "hi",
                   "--connect-timeout", "0.5"])
    assert rc == 1  # it ran: no scheduler there, as in the test above
    err = capsys.readouterr().err
    assert ("llmserve generate: warning: LLMSERVE_REDISURL is set but no llmserve flag reads it (did you mean "
            "LLMSERVE_REDIS_URL?); it is ignored") in err


@pytest.mark.parametrize(("flag", "value", "reason"), [
    ("--max-tokens", "-5", "must be in 0..4294967295, got -5"),
    ("--sampling-seed", "-1", "must be in 0..18446744073709551615, got -1"),
    ("--sampling-seed", "x", "not an integer: 'x'"),
])
def test_generate_refuses_what_its_request_cannot_hold(flag: str, value: str, reason: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before a connection is made, naming the flag (protobuf's own error said "Value out of range: -5")."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["generate", "--prompt", "hi", flag, value])
    assert exited.value.code == 2
    assert f"llmserve generate: error: argument {flag}: {reason}" in capsys.readouterr().err
    assert getattr(build_parser().parse_args(["generate", flag, "0"]), flag[2:].replace("-", "_")) == 0
