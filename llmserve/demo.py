"""`llmserve demo` / `make run`: start the local server, stream a few chat answers, stop."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, ClusterStartError, LocalCluster

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in two sentences what a KV cache is in a language model.",
]


def run_demo(model: str, max_tokens: int, max_model_len: int, log_dir: str, start_timeout_s: float,
             progress: Callable[[str], None]) -> int:
    """Streams each prompt's answer to stdout; returns a process exit code."""
    worker_args = ["--max-model-len", str(max_model_len)] if max_model_len else ["--max-model-len", "2048"]
    print("Starting Redis, a worker and a scheduler on localhost...", flush=True)
    spec = ClusterSpec(model=model, worker_args=worker_args, log_dir=log_dir, start_timeout_s=start_timeout_s)
    try:
        cluster = LocalCluster(spec, progress=progress).start()
    except ClusterStartError as exc:
        print(f"llmserve demo: error: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"Serving after {cluster.startup_report().summary()}: Generation API on {cluster.address}\n",
              flush=True)
        with GenerationClient(cluster.address) as client:
            for prompt in DEMO_PROMPTS:
                print(f">>> {prompt}", flush=True)
                request = make_request(messages=[("user", prompt)], max_tokens=max_tokens, temperature=0.0)
                t0 = time.monotonic()
                tokens = 0
                for msg in client.stream(request, timeout=300):
                    for delta in msg.outputs:
                        sys.stdout.write(delta.text)
                        tokens += len(delta.token_ids)
                    sys.stdout.flush()
                print(f"\n    [{tokens} tokens in {time.monotonic() - t0:.1f}s]\n", flush=True)
        print("Stopping the local server.", flush=True)
    finally:
        cluster.stop()
    return 0
