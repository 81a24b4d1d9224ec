"""The `llmserve` command line.

Flags use vLLM's names where one exists. Every flag can also come from an
environment variable, LLMSERVE_<FLAG> (e.g. LLMSERVE_REDIS_URL), for containers;
a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from llmserve import security_flags as sec
from shared import defaults
from shared.startup_heap import pause_collection
from shared.startup_timer import NUMBA_COMPILE_NOTE, StartupReport, StartupTimer

if TYPE_CHECKING:  # grpc loads only when a command builds its config
    from shared.tls import ServerTLS

ENV_PREFIX = "LLMSERVE_"


def env_defaults(parser: argparse.ArgumentParser) -> None:
    """Fills flag defaults from LLMSERVE_* variables (read when the CLI runs, never at import)."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public iterator over actions
        if not action.option_strings or action.dest in ("help",):
            continue
        value = os.environ.get(ENV_PREFIX + action.dest.upper())
        if value is None:
            continue
        action.default = _env_value(action, ENV_PREFIX + action.dest.upper(), value)
        action.required = False
        action.help = f"{action.help} [env {ENV_PREFIX + action.dest.upper()}]"


class BadEnvValue:
    """A LLMSERVE_* variable holding a value its flag would refuse, in place of the flag's default: argparse takes a
    default as it is, and every command's parser reads the variables, so only the command that uses the flag
    reports it (`bad_env_values`), as argparse would a bad flag, rather than failing later with a traceback."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:  # --help's %(default)s
        return f"<{self.message}>"


# LLMSERVE_* variables that are not flags: secrets kept out of argv, the model cache, and the test suite's settings
# (which reach the services its tests start).
_OTHER_VARIABLES = (sec.AUTH_TOKEN_ENV, sec.REDIS_PASSWORD_ENV, sec.API_KEY_ENV, "LLMSERVE_CACHE",
                    "LLMSERVE_HYPOTHESIS", "LLMSERVE_FAULT_TABLE", "LLMSERVE_SOAK_SECONDS", "LLMSERVE_SOAK_REPORT",
                    "LLMSERVE_TOKENIZER_DIR")


def unknown_env_names(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """Warnings for the LLMSERVE_* variables that no flag of any command reads, with the likeliest meant name.

    A misspelt key in a ConfigMap would otherwise be ignored without a word and its flag left at its default.
    Variables of the other commands' flags are not named: one ConfigMap often serves several commands.
    """
    known = set(_OTHER_VARIABLES)
    parsers = [parser]
    while parsers:
        for action in parsers.pop()._actions:  # noqa: SLF001 - argparse has no public iterator over actions
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                parsers.extend(action.choices.values())
            elif action.option_strings:
                known.add(ENV_PREFIX + action.dest.upper())
    warnings = []
    for name in sorted(n for n in environ if n.startswith(ENV_PREFIX) and n not in known):
        # Matched without the prefix, which every name shares.
        near = difflib.get_close_matches(name[len(ENV_PREFIX):], sorted(k[len(ENV_PREFIX):] for k in known), n=1)
        hint = f" (did you mean {ENV_PREFIX}{near[0]}?)" if near else ""
        warnings.append(f"{name} is set but no llmserve flag reads it{hint}; it is ignored")
    return warnings


def bad_env_values(args: argparse.Namespace) -> list[str]:
    """What is wrong with the LLMSERVE_* variables this command's flags were given."""
    return [value.message for value in vars(args).values() if isinstance(value, BadEnvValue)]


def _env_value(action: argparse.Action, name: str, value: str) -> object:
    """A flag's value from its LLMSERVE_* variable, converted and checked as argparse does a flag's."""
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):  # noqa: SLF001
        if value.lower() not in _TRUE + _FALSE:
            return BadEnvValue(f"{name}={value!r}: expected {'/'.join(_TRUE)} or {'/'.join(_FALSE[:-1])} (or empty)")
        return value.lower() in _TRUE
    appends = isinstance(action, argparse._AppendAction)  # noqa: SLF001
    converted = []
    for item in [v for v in value.split(",") if v] if appends else [value]:
        try:
            one = action.type(item) if callable(action.type) else item
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            name_of_type = getattr(action.type, "__name__", "value")
            reason = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else f"not a valid {name_of_type}"
            return BadEnvValue(f"{name}={item!r}: {reason}")
        if action.choices is not None and one not in action.choices:
            return BadEnvValue(f"{name}={item!r}: expected one of {', '.join(map(str, action.choices))}")
        converted.append(one)
    return converted if appends else converted[0]


_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no", "")


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer in low..high, `what` naming it when the text is none."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    return parse


# Larger ports are not refused by the sockets below: gRPC keeps the low 16 bits (`up --port 99999` served on 34463
# while it said 99999).
_port = _int_in(0, 65535, "a port number")
# What the request's protobuf uint32 / uint64 fields hold (protobuf's own error says only "Value out of range").
_uint32, _uint64 = _int_in(0, (1 << 32) - 1, "an integer"), _int_in(0, (1 << 64) - 1, "an integer")


def _model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="local Hugging Face checkpoint directory (Llama, Mistral, Qwen2, OPT, "
                   "GPT-2) or a .gguf file transformers reads; default: the bundled SmolLM2-135M-Instruct, converted "
                   "on first use")


def _worker_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and KV-cache dtype; auto = float32 on a CPU")
    g.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda, cuda:1)")
    g.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE, choices=[8, 16, 32], help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory", type=float, default=defaults.KV_CACHE_MEMORY_GIB, help="GiB of memory for the KV cache on a CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=defaults.GPU_MEMORY_UTILIZATION,
                   help="fraction of GPU memory for the model and its KV cache, sized by a profiling step")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="exact number of KV-cache blocks")
    g.add_argument("--swap-space", type=float, default=defaults.SWAP_SPACE_GIB, help="GiB of host memory for swapped-out blocks")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded random sampling")
    g.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    g.add_argument("--decode-gemv-rows", type=int, default=defaults.DECODE_GEMV_ROWS,
                   help="decode steps of up to this many sequences run every layer in one compiled call with "
                        "GEMV projections over a dense copy of the layer weights (float32 or bf16 on a CPU, projections "
                        "not in panels; the copy costs the weights' size in memory again); 0 = off")
    g.add_argument("--cpu-matmul", choices=defaults.CPU_MATMULS, default=defaults.CPU_MATMULS[0],
                   help="kernel of the float32 CPU projections: auto (Numba panel tiles on AVX-512 AMD CPUs, "
                        "else oneDNN), onednn or panels (with panels, every decode step runs every layer in one "
                        "compiled call over them)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes (GPUs cuda:k..k+N-1, or CPU processes with gloo) that split each layer's heads "
                        "and the KV cache; the worker starts them. --kv-cache-memory, --swap-space and "
                        "--num-threads apply to each")
    g.add_argument("--simulate", default="", metavar="PROFILE",
                   help="serve the Worker API with no model: steps take the time a profile of a model on a GPU "
                        "gives them (worker_service/profiles: llama-3-8b-h100, llama-3-70b-h100x4, or a JSON file) "
                        "and tokens are a function of sequence, position and seed; --model still gives the "
                        "vocabulary the scheduler tokenizes with")


def _scheduler_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget of one step (default: {defaults.CPU_STEP_BUDGET} for a CPU worker with "
                        "chunked prefill, 512 for another; max(max_model_len, 2048) without chunked prefill)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts into chunks that share each step's budget with running decodes "
                        "(default: on for CPU workers, off for others)")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV blocks of prompts that share a prefix with earlier requests")
    g.add_argument("--profile-steps", default="", metavar="PATH",
                   help="append each engine step's time split (schedule, plan, RPC, worker, commit, postprocess) "
                        "to this JSON-lines file")
    g.add_argument("--max-num-queued-requests", type=int, default=0,
                   help="per worker, the most requests admitted but not yet scheduled (0 = unbounded); beyond it "
                        "Generate answers RESOURCE_EXHAUSTED at once")
    g.add_argument("--max-queued-tokens", type=int, default=0,
                   help="per worker, the most prompt tokens of requests admitted but not yet scheduled "
                        "(0 = unbounded); an empty queue always takes one request")
    g.add_argument("--step-timeout", type=float, default=defaults.STEP_TIMEOUT_S, metavar="SECONDS",
                   help="deadline of one worker step; a step past it is handled as a worker failure")
    g.add_argument("--async-scheduling", action="store_true",
                   help="plan and send the next step while the worker runs the current one, hiding the "
                        "scheduler's per-step time where the worker's host has cores to spare (a GPU worker); "
                        "beam search always waits for each result")
    g.add_argument("--num-scheduler-steps", type=int, default=defaults.NUM_SCHEDULER_STEPS, metavar="N",
                   help="run a batch of decodes N steps per call to the worker (multi-step scheduling): one "
                        "round trip and one commit for N tokens of every sequence; tokens stream in bursts of N "
                        f"(1..{defaults.MAX_NUM_SCHEDULER_STEPS}; not with --async-scheduling)")
    g.add_argument("--output-retention", type=int, default=defaults.OUTPUT_RETENTION_S, metavar="SECONDS",
                   help="how long a finished request's output stays in Redis for Resume and idempotent re-sends; "
                        "each generated token keeps ~50 bytes there that long")


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-model-len", type=int, default=0, help="longest prompt + output (0 = the model's limit)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def _ready_fd_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ready-fd", type=int, default=None, metavar="FD",
                   help="inherited file descriptor to write a JSON line to when ready, with the start-up's phases "
                        "(how `llmserve up` learns it at once)")


def _liveness_flag(p: argparse.ArgumentParser, stalled: str) -> None:
    p.add_argument("--liveness-timeout", type=float, default=defaults.LIVENESS_TIMEOUT_S, metavar="SECONDS",
                   help=f"grpc.health.v1 service 'liveness' (the Kubernetes liveness probe) turns NOT_SERVING when "
                        f"{stalled} for this long; keep it well above --step-timeout")


def _engine_metrics_flags(host: str, metrics_port: int) -> list[str]:
    """The HTTP front's --engine-metrics under `up`: the scheduler's port and the worker's (the next one)."""
    if not metrics_port:
        return []
    return [flag for port in (metrics_port, metrics_port + 1)
            for flag in ("--engine-metrics", f"http://{host}:{port}/metrics")]


def _observability_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observability")
    g.add_argument("--otlp-endpoint", default="",
                   help="send OpenTelemetry spans to this OTLP/gRPC collector (host:port; OTEL_EXPORTER_OTLP_ENDPOINT "
                        "also works)")
    g.add_argument("--trace-file", default="", metavar="PATH",
                   help="append OpenTelemetry spans to this JSON-lines file (read by `llmserve trace show`)")
    g.add_argument("--metrics-port", type=_port, default=0,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = off; `up` gives the worker PORT+1)")


def _output_parser_flags(p: argparse.ArgumentParser) -> None:
    # Light modules (json, dataclasses), but the front's package: imported when the parser is built.
    from openai_api.reasoning import REASONING_PARSERS  # noqa: PLC0415
    from openai_api.tool_parsers import TOOL_CALL_PARSERS  # noqa: PLC0415

    g = p.add_argument_group("reading generated text (the HTTP front)")
    g.add_argument("--reasoning-parser", default="", choices=REASONING_PARSERS,
                   help="how the model marks its thinking: chat responses carry it apart from the content, as "
                        "`reasoning` (vLLM's flag): deepseek_r1 (the output starts inside <think>) or qwen3 (<think> "
                        "opens it)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default with tools): the model writes calls in its own syntax, '
                        "read by --tool-call-parser (vLLM's flags); without it, \"auto\" with tools is a 400")
    g.add_argument("--tool-call-parser", default="", choices=TOOL_CALL_PARSERS,
                   help="how the model writes tool calls: hermes (<tool_call> tags: Hermes, Qwen 2.5, ...) or "
                        "llama3_json (Llama 3.1 / 3.2)")


def _tool_call_parser(args: argparse.Namespace) -> str:
    """The front's parser for tool_choice "auto": both flags or neither, as vLLM has them."""
    if args.enable_auto_tool_choice != bool(args.tool_call_parser):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: the parser reads the calls "
                         "that auto tool choice lets the model write")
    return args.tool_call_parser


def _up_security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (the worker stays plaintext on localhost)")
    g.add_argument("--tls-cert-file", default="", metavar="PEM", help="serve the Generation API over TLS")
    g.add_argument("--tls-key-file", default="", metavar="PEM", help="private key of --tls-cert-file")
    g.add_argument("--tls-ca-file", default="", metavar="PEM",
                   help="CA of --tls-cert-file, trusted by `up`'s readiness check and the HTTP front")
    sec.add_auth_token_flag(p, "the Generation API requires (the HTTP front sends it)")
    g.add_argument("--redis-password-file", default="", metavar="PATH", help="Redis AUTH password, with --redis-url")
    g.add_argument("--redis-ca-file", default="", metavar="PEM", help="CA of a rediss:// --redis-url")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=_uint32, default=128,
                   help="tokens to generate at most (0 = up to the model's context length)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--sampling-seed", type=_uint64, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")


def _start_timeout_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--start-timeout", type=float, default=defaults.LOCAL_START_TIMEOUT_S, metavar="SECONDS",
                   help="seconds the services may take to start before it gives up (a first start on a machine "
                        "compiles the CPU kernels: 2-4 min on 2 cores); while they start it says every "
                        f"{defaults.START_PROGRESS_EVERY_S:.0f} s what it waits for")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="run Redis, one worker and one scheduler on localhost")
    _model_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address the services bind")
    p.add_argument("--port", type=_port, default=50051, help="port of the public Generation API")
    p.add_argument("--redis-url", default="", help="use this Redis instead of starting an embedded redis-server")
    p.add_argument("--log-dir", default="", help="where the services write their logs (default: a temp dir)")
    _start_timeout_flag(p)
    p.add_argument("--http-port", type=_port, default=None,
                   help="also start the OpenAI-compatible HTTP API (`llmserve openai`) on this port")
    _liveness_flag(p, "the engine loop holds requests but completes no step, or a worker step runs")
    _worker_flags(p), _scheduler_flags(p), _common_flags(p), _observability_flags(p)
    _up_security_flags(p), _output_parser_flags(p)

    p = sub.add_parser("demo", help="start the local server, stream answers to a few chat prompts, stop")
    _model_flag(p)
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    p.add_argument("--log-dir", default="", help="where the services write their logs (default: a temp dir)")
    _start_timeout_flag(p)
    _common_flags(p)

    p = sub.add_parser("worker", help="run a worker (model + paged KV cache)")
    _model_flag(p)
    p.add_argument("--host", default="0.0.0.0", help="address to bind")
    p.add_argument("--port", type=_port, default=50061, help="port of the Worker API")
    p.add_argument("--redis-url", default="", help="register in this Redis so that schedulers find the worker "
                   "(without it the worker serves only callers that know its address)")
    p.add_argument("--advertise-address", default="", help="host:port schedulers dial (default: this host's name "
                   "and --port; in Kubernetes the pod's DNS name)")
    p.add_argument("--heartbeat-ttl", type=float, default=6.0, metavar="SECONDS",
                   help="the worker counts as gone this long after its last heartbeat")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, longest wait for the scheduler to finish or hand over this worker's requests")
    _liveness_flag(p, "one step (a forward pass) has been executing")
    _worker_flags(p), _common_flags(p), _observability_flags(p), _ready_fd_flag(p)
    sec.add_server_tls_flags(p, "the Worker API", "require client certificates signed by this CA (mutual TLS: "
                             "only a scheduler holding one can drive the worker)")
    sec.add_redis_security_flags(p)

    p = sub.add_parser("scheduler", help="run a scheduler replica (public API + engine loops)")
    _model_flag(p)
    p.add_argument("--host", default="0.0.0.0", help="address to bind")
    p.add_argument("--port", type=_port, default=50051, help="port of the public Generation API")
    p.add_argument("--redis-url", required=True, help="Redis holding the scheduling state (redis://host:port/db)")
    p.add_argument("--lease-ttl", type=float, default=defaults.LEASE_TTL_S, metavar="SECONDS",
                   help="a worker's engine loop moves to another replica this long after its owner stops renewing")
    p.add_argument("--front-only", action="store_true",
                   help="serve clients only: drive no worker (take no lease), so that client streams and engine "
                        "loops scale on separate replicas")
    _liveness_flag(p, "an engine loop of this replica holds requests but has completed no step")
    _scheduler_flags(p), _common_flags(p), _observability_flags(p), _ready_fd_flag(p)
    sec.add_server_tls_flags(p, "the public Generation API",
                             "also require client certificates signed by this CA on the public API (mutual TLS)")
    sec.add_auth_token_flag(p, "every public API call must carry (authorization: Bearer <token>)")
    sec.add_worker_client_tls_flags(p)
    sec.add_redis_security_flags(p)

    p = sub.add_parser("generate", help="stream a completion from a running server")
    p.add_argument("--address", default="127.0.0.1:50051", help="scheduler address host:port")
    p.add_argument("--prompt", default="", help="plain-text prompt")
    p.add_argument("--chat", action="append", default=[], help="user message, rendered with the chat template (repeatable: alternating user/assistant)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the call in seconds")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="fail when the scheduler accepts no connection within this time (0: wait up to --timeout)")
    _sampling_flags(p)
    sec.add_client_security_flags(p)

    p = sub.add_parser("openai", help="run the OpenAI-compatible HTTP API, a client of a scheduler's gRPC API")
    p.add_argument("--host", default="0.0.0.0", help="address to bind")
    p.add_argument("--port", type=_port, default=8000, help="HTTP port")
    p.add_argument("--scheduler", default="127.0.0.1:50051", help="scheduler (or its load balancer) host:port")
    p.add_argument("--served-model-name", action="append", default=[],
                   help="model name clients send (repeatable; the first is the default); default: the name of the "
                        "--tokenizer directory, else llmserve")
    p.add_argument("--tokenizer", default="", help="checkpoint whose tokenizer names tokens in logprobs "
                   "(default: none, tokens are named token_id:<id>)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, longest wait for the responses in flight to finish (new connections are "
                        "refused meanwhile); those still open then are cut")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no log line per HTTP request (vLLM's flag); errors are still logged")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens token_id:<id> rather than their text, unless a request's own "
                        "return_tokens_as_token_ids says otherwise (vLLM's flag)")
    _output_parser_flags(p)
    p.add_argument("--engine-metrics", action="append", default=[], metavar="URL",
                   help="Prometheus endpoint of the engine (a scheduler's or worker's --metrics-port, e.g. "
                        "http://127.0.0.1:9090/metrics) whose series /metrics serves after the front's own, as "
                        "vLLM's API server does (repeatable; `up --http-port --metrics-port` sets both)")
    sec.add_client_security_flags(p)
    g = p.add_argument_group("HTTPS and browsers")
    g.add_argument("--http-tls-cert-file", default="", metavar="PEM",
                   help="serve HTTPS with this certificate (chain); needs --http-tls-key-file")
    g.add_argument("--http-tls-key-file", default="", metavar="PEM", help="private key of --http-tls-cert-file")
    g.add_argument("--http-tls-client-ca-file", default="", metavar="PEM",
                   help="also require HTTP clients to present a certificate this CA signed (mutual TLS)")
    g.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                   help="an origin (https://app.example.com, or *) whose browser pages may call the API (CORS; "
                        "repeatable; vLLM's flag). Default: none, no CORS headers")
    p.add_argument("--api-key-file", default="", metavar="PATH",
                   help="file holding the key HTTP clients must send as 'Authorization: Bearer <key>' on /v1 "
                        f"(vLLM's --api-key; or the key itself in {sec.API_KEY_ENV}); /health stays open")

    p = sub.add_parser("trace", help="read the spans the services wrote with --trace-file")
    show = p.add_subparsers(dest="trace_command", required=True).add_parser(
        "show", help="draw one request's waterfall across scheduler steps and worker executions")
    show.add_argument("request_id", help="the request id (gen_ai.request.id)")
    show.add_argument("--trace-file", action="append", default=[], metavar="PATH", required=True,
                      help="JSON-lines span file (repeatable: e.g. the scheduler's and the worker's)")
    show.add_argument("--html", default="", metavar="OUT.html", help="also write the waterfall as an HTML page")
    show.add_argument("--width", type=int, default=60, help="characters of the timeline bars")
    env_defaults(show)

    # Listed here for `llmserve --help`; main() hands its arguments to benchmarks.serving, whose
    # parser documents them (`llmserve bench --help`).
    sub.add_parser("bench", add_help=False,
                   help="serving benchmark (vLLM's metrics) against transformers, or against --address")

    p = sub.add_parser("prepare-model", help="convert the bundled default model to safetensors (once)")
    for sp in sub.choices.values():
        env_defaults(sp)
    return parser


def _cmd_bench(bench_args: list[str]) -> int:
    try:
        from benchmarks.serving import main as serving_main  # noqa: PLC0415 - heavy: transformers, torch
    except ImportError as exc:
        print(f"llmserve bench: error: the benchmarks are not installed with this copy of llmserve ({exc})",
              file=sys.stderr)
        return 2
    serving_main(bench_args)
    return 0


def _resolve_model(model: str) -> str:
    if model:
        return model
    from shared.default_model import prepare_default_model  # noqa: PLC0415

    return str(prepare_default_model())


def _startup_timer(args: argparse.Namespace, cpu: bool = True) -> StartupTimer:
    """The command's start-up timer, started when main() began (the imports to come are its first phase).

    cpu: report the process's CPU time (a service's own work; not `up`'s, whose time is its services').
    """
    return StartupTimer(getattr(args, "started_at", None), cpu_clock=time.process_time if cpu else None)


def _ready_notice(args: argparse.Namespace, event: str) -> Callable[[StartupReport], None] | None:
    """Writes `event` with the start-up report to --ready-fd (see llmserve/ready_pipe.py); None without it."""
    if args.ready_fd is None:
        return None
    from llmserve.ready_pipe import ReadyNotifier  # noqa: PLC0415

    notifier = ReadyNotifier(args.ready_fd)
    return lambda report: notifier.notify(event, report)


def _cmd_worker(args: argparse.Namespace) -> int:
    from shared.omp import prefer_short_spins  # noqa: PLC0415

    pause_collection()  # until the worker has loaded (shared/startup_heap.py)
    prefer_short_spins()
    timer = _startup_timer(args)
    with timer.phase("imports", note=NUMBA_COMPILE_NOTE):  # the kernels compile as their modules load
        import asyncio  # noqa: PLC0415 - keep `llmserve --help` and `up` fast

        from worker_service.config import WorkerConfig  # noqa: PLC0415
        from worker_service.server import serve  # noqa: PLC0415

    config = WorkerConfig(
        model=_resolve_model(args.model), dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        swap_space_gib=args.swap_space, max_model_len=args.max_model_len, seed=args.seed,
        num_threads=args.num_threads, otlp_endpoint=args.otlp_endpoint, trace_file=args.trace_file,
        metrics_port=args.metrics_port, tls=sec.server_tls_from(args),
        tensor_parallel_size=args.tensor_parallel_size, liveness_timeout_s=args.liveness_timeout,
        simulate=args.simulate, decode_gemv_rows=args.decode_gemv_rows,
        cpu_matmul=args.cpu_matmul,
    )
    registration = None
    if args.redis_url:
        from worker_service.registration import RegistrationConfig  # noqa: PLC0415

        advertise = args.advertise_address or f"{_advertised_host(args.host)}:{args.port}"
        registration = RegistrationConfig(args.redis_url, advertise, heartbeat_ttl_s=args.heartbeat_ttl,
                                          drain_timeout_s=args.drain_timeout, redis=sec.redis_options_from(args))
    asyncio.run(serve(config, args.host, args.port, registration=registration, startup=timer,
                      on_ready=_ready_notice(args, "ready")))
    return 0


def _advertised_host(bind_host: str) -> str:
    """The name other hosts reach a server by: the bound address, or the host name for a wildcard bind."""
    import socket  # noqa: PLC0415

    return socket.gethostname() if bind_host in ("0.0.0.0", "::", "") else bind_host


def _cmd_scheduler(args: argparse.Namespace) -> int:
    pause_collection()  # until the replica has loaded (shared/startup_heap.py)
    timer = _startup_timer(args)
    with timer.phase("imports"):
        import asyncio  # noqa: PLC0415

        from scheduler_service.config import SchedulerServiceConfig  # noqa: PLC0415
        from scheduler_service.server import serve  # noqa: PLC0415

    config = SchedulerServiceConfig(
        tokenizer=_resolve_model(args.model), redis_url=args.redis_url,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching, profile_steps=args.profile_steps,
        otlp_endpoint=args.otlp_endpoint, trace_file=args.trace_file, metrics_port=args.metrics_port,
        max_num_queued_requests=args.max_num_queued_requests, max_queued_tokens=args.max_queued_tokens,
        step_timeout_s=args.step_timeout, async_scheduling=args.async_scheduling, lease_ttl_s=args.lease_ttl,
        num_scheduler_steps=args.num_scheduler_steps, output_retention_s=args.output_retention,
        liveness_timeout_s=args.liveness_timeout, front_only=args.front_only,
        tls=sec.server_tls_from(args), auth_token=sec.auth_token_from(args), worker_tls=sec.worker_tls_from(args),
        redis=sec.redis_options_from(args),
    )
    asyncio.run(serve(config, args.host, args.port, startup=timer, on_ready=_ready_notice(args, "ready"),
                      on_serving=_ready_notice(args, "serving")))
    return 0


def _passthrough(args: argparse.Namespace, names: list[str]) -> list[str]:
    """Re-creates the command-line flags `up` forwards to one service."""
    from llmserve.local_cluster import service_flag  # noqa: PLC0415 - `up` imports the cluster lazily too

    return [flag for name in names for flag in service_flag(name, getattr(args, name.replace("-", "_")))]


_WORKER_PASS = ["dtype", "device", "block-size", "kv-cache-memory", "gpu-memory-utilization",
                "num-gpu-blocks-override", "swap-space", "seed", "num-threads", "max-model-len", "log-level",
                "otlp-endpoint", "trace-file", "redis-password-file", "redis-ca-file", "tensor-parallel-size",
                "liveness-timeout", "simulate", "decode-gemv-rows", "cpu-matmul"]
_SCHEDULER_PASS = ["max-num-seqs", "max-num-batched-tokens", "enable-chunked-prefill", "enable-prefix-caching",
                   "profile-steps", "max-model-len", "log-level", "otlp-endpoint", "trace-file", "metrics-port",
                   "max-num-queued-requests", "max-queued-tokens", "step-timeout", "async-scheduling",
                   "num-scheduler-steps", "output-retention", "liveness-timeout", "tls-cert-file", "tls-key-file", "auth-token-file", "redis-password-file", "redis-ca-file"]
# The HTTP front is a client of the scheduler: it trusts the CA and sends the token.
_HTTP_PASS = ["tls-ca-file", "auth-token-file", "enable-auto-tool-choice", "tool-call-parser", "reasoning-parser"]


def _check_start_timeout(args: argparse.Namespace) -> None:
    if not args.start_timeout > 0:
        raise ValueError(f"{args.command}: --start-timeout must be positive, got {args.start_timeout}")


def _say_progress(line: str) -> None:
    print(f"llmserve: {line}", flush=True)


def _cmd_up(args: argparse.Namespace) -> int:
    timer = _startup_timer(args, cpu=False)
    with timer.phase("imports"):
        from llmserve.local_cluster import ClusterSpec, ClusterStartError, LocalCluster  # noqa: PLC0415

    if args.tls_cert_file and not args.tls_ca_file:
        raise ValueError("up: --tls-cert-file needs --tls-ca-file, the CA that signed it: `up` checks the "
                         "scheduler's readiness and the HTTP front reaches it over TLS")
    _check_start_timeout(args)
    if (_tool_call_parser(args) or args.reasoning_parser) and args.http_port is None:
        raise ValueError("up: --enable-auto-tool-choice, --tool-call-parser and --reasoning-parser apply to the HTTP "
                         "front: set --http-port")
    spec = ClusterSpec(
        model=_resolve_model(args.model), host=args.host, port=args.port, redis_url=args.redis_url,
        worker_args=_passthrough(args, _WORKER_PASS) + (["--metrics-port", str(args.metrics_port + 1)]
                                                        if args.metrics_port else []),
        scheduler_args=_passthrough(args, _SCHEDULER_PASS),
        log_dir=args.log_dir, http_port=args.http_port,
        http_args=_passthrough(args, _HTTP_PASS) + _engine_metrics_flags(args.host, args.metrics_port),
        tls_ca_file=args.tls_ca_file, start_timeout_s=args.start_timeout,
    )
    stop, started = threading.Event(), threading.Event()
    cluster = LocalCluster(spec, startup=timer, progress=_say_progress)

    def _stop(signum: int, frame: object) -> None:
        if not started.is_set():
            # Start-up can wait minutes (kernels compiling, a Redis that does not answer): a service manager's
            # SIGTERM ends it now, and cluster.start() stops what it started on the way out.
            raise _StopSignal(signum)
        if stop.is_set():  # a second Ctrl-C: no more waiting for the orderly stop
            cluster.kill_all()
        stop.set()

    # SIGHUP too: a closed terminal no longer reaches the services, which run in sessions of their own.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    try:
        cluster.start()  # stops whatever it started when one service fails
        started.set()
        # From here on Ctrl-C (SIGINT, the terminal's: the services run in sessions of their own and do
        # not get it) stops the cluster in order, however soon it comes. An Event, not a flag tested
        # before signal.pause(): a signal between the test and the pause would be missed.
        signal.signal(signal.SIGINT, _stop)
        # Where the start-up went; each service's log has its own line (`worker ready in ...`).
        print(f"llmserve up: serving after {cluster.startup_report().summary()}", flush=True)
        http = f", OpenAI API on {cluster.http_url}/v1" if cluster.http_url else ""
        print(f"llmserve is up: Generation API on {cluster.address}{http} (logs in {cluster.log_dir}); "
              "Ctrl-C stops it", flush=True)
        while not stop.wait(0.5):
            # A service that died is not restarted here: the others would serve nothing (or half) in silence.
            if gone := cluster.exited():
                print(f"llmserve up: error: {gone}\nstopping the other services", file=sys.stderr, flush=True)
                return 1
        print("stopping (the worker drains first; Ctrl-C again kills)...", flush=True)
    except ClusterStartError as exc:
        # A service that refused its flags (or died starting) says why in its log's tail: no traceback of `up`'s.
        print(f"llmserve up: error: {exc}", file=sys.stderr)
        return 1
    except _StopSignal as exc:
        print(f"llmserve up: stopped by {signal.Signals(exc.signum).name} during start-up", file=sys.stderr)
        return 128 + exc.signum
    finally:
        cluster.stop()
    return 0


class _StopSignal(BaseException):
    """SIGTERM or SIGHUP while `up` starts its services, or during `demo`. A BaseException, as KeyboardInterrupt
    is: no handler of ordinary errors on the way catches it, and the cluster's stop() runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _cmd_generate(args: argparse.Namespace) -> int:
    from llmserve.client import GenerationClient, make_request  # noqa: PLC0415
    from protos import common_pb2  # noqa: PLC0415

    if bool(args.prompt) == bool(args.chat):
        # Checked here, not by the server, whose message names Generate's fields (prompt_token_ids, messages).
        print("llmserve generate: error: give --prompt or --chat (one of them)", file=sys.stderr)
        return 2
    messages = [("user" if i % 2 == 0 else "assistant", m) for i, m in enumerate(args.chat)]
    sampling: dict[str, object] = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.sampling_seed is not None:
        sampling["seed"] = args.sampling_seed
    request = make_request(prompt=args.prompt, messages=messages, **sampling)
    import grpc  # noqa: PLC0415

    with GenerationClient(args.address, sec.client_tls_from(args), sec.auth_token_from(args)) as client:
        if args.connect_timeout > 0:
            try:
                client.wait_for_server(args.connect_timeout)
            except ConnectionError as exc:
                print(f"error: {exc}: is it running there, and does --tls-ca-file match its TLS (set for a TLS "
                      "scheduler, unset for a plaintext one)?", file=sys.stderr)
                return 1
        try:
            for msg in client.stream(request, timeout=args.timeout):
                for delta in msg.outputs:
                    sys.stdout.write(delta.text)
                    if delta.finish_reason:
                        reason = common_pb2.FinishReason.Name(delta.finish_reason).removeprefix("FINISH_REASON_")
                        sys.stdout.write(f"\n[finish: {reason.lower()}]")
                sys.stdout.flush()
                if msg.HasField("usage"):
                    print(f" [prompt tokens: {msg.usage.prompt_tokens}, completion tokens: {msg.usage.completion_tokens}]")
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    return 0


def _cmd_openai(args: argparse.Namespace) -> int:
    from openai_api.server import FrontConfig, serve  # noqa: PLC0415

    serve(FrontConfig(scheduler=args.scheduler, host=args.host, port=args.port,
                      served_model_names=args.served_model_name, tokenizer=args.tokenizer,
                      scheduler_tls=sec.client_tls_from(args), auth_token=sec.auth_token_from(args),
                      api_key=sec.api_key_from(args), engine_metrics=args.engine_metrics,
                      drain_timeout_s=args.drain_timeout, access_log=not args.disable_uvicorn_access_log,
                      tool_call_parser=_tool_call_parser(args), reasoning_parser=args.reasoning_parser,
                      return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                      tls=_http_tls(args), allowed_origins=args.allowed_origins),
          args.log_level)
    return 0


def _http_tls(args: argparse.Namespace) -> ServerTLS | None:
    from shared.tls import server_tls  # noqa: PLC0415

    return server_tls(args.http_tls_cert_file, args.http_tls_key_file, args.http_tls_client_ca_file, "http-tls")


def _cmd_trace(args: argparse.Namespace) -> int:
    from shared.tracing_view import load_spans, render_html, render_text, request_waterfall  # noqa: PLC0415

    waterfall = request_waterfall(load_spans(args.trace_file), args.request_id)
    print(render_text(waterfall, width=args.width))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_html(waterfall))
        print(f"wrote {args.html}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from llmserve.demo import run_demo  # noqa: PLC0415

    _check_start_timeout(args)

    def _stop(signum: int, frame: object) -> None:
        raise _StopSignal(signum)  # as Ctrl-C does: the demo's services stop on the way out

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    return run_demo(_resolve_model(args.model), args.max_tokens, args.max_model_len, args.log_dir,
                    args.start_timeout, _say_progress)


def _cmd_prepare_model(args: argparse.Namespace) -> int:
    print(_resolve_model(""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _cmd_bench(argv[1:])
    started_at = time.monotonic()  # a service's start-up line counts from here
    parser = build_parser()
    args = parser.parse_args(argv)
    if bad := bad_env_values(args):
        print(f"llmserve {args.command}: error: {bad[0]}", file=sys.stderr)
        return 2
    for warning in unknown_env_names(parser, os.environ):
        print(f"llmserve {args.command}: warning: {warning}", file=sys.stderr)
    args.started_at = started_at
    from shared.logging_setup import setup_logging  # noqa: PLC0415

    setup_logging(getattr(args, "log_level", "INFO"), name=args.command)
    handlers = {
        "up": _cmd_up, "demo": _cmd_demo, "worker": _cmd_worker, "scheduler": _cmd_scheduler,
        "generate": _cmd_generate, "openai": _cmd_openai, "prepare-model": _cmd_prepare_model,
        "trace": _cmd_trace,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except _StopSignal as exc:  # `demo`'s, or a second one while `up` stopped what its start-up began
        print(f"llmserve {args.command}: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
    except (ValueError, FileNotFoundError) as exc:
        print(f"llmserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from shared.errors import StartupError  # noqa: PLC0415 - grpc stays out of `llmserve --help`

        if not isinstance(exc, StartupError):
            raise
        print(f"llmserve {args.command}: error: {exc}", file=sys.stderr)
        return 1
