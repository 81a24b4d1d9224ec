"""Runs llama.cpp's `llama-server` on a GGUF file for the duration of a `with` block.

Everything not set here keeps llama-server's defaults (continuous batching, batch sizes, F16 KV cache,
flash-attention "auto", prompt cache): what a user starting it on this machine would get.

OpenMP's wait policy is left at libgomp's default too (threads spin a while before they sleep). The
CPU build runs every graph in an OpenMP parallel region with a `#pragma omp barrier` between ops, so
the policy decides both its speed on idle cores and what other load costs it. Measured on this
2-core machine, single stream, F32, 2 threads: idle, 15 ms per token with the default against 28 ms
with OMP_WAIT_POLICY=PASSIVE (what llmserve's worker uses, shared/omp.py); while other jobs kept it
busy (load ~5), 342 and 718 ms with the default against 35 and 42 ms with PASSIVE. The benchmark
runs on an idle machine, where the default is llama.cpp's best; `--omp-wait-policy` sets another.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from llmserve.local_cluster import wait_http_ok
from shared.processes import terminate
from shared.redis_server import free_port


@dataclass(frozen=True)
class LlamaServerSpec:
    """One llama-server: the GGUF it serves, its slots, the context each slot gets and its threads."""

    server: Path
    model: Path
    parallel: int
    slot_context: int
    threads: int
    # OMP_WAIT_POLICY of the server; "" leaves the environment's (and libgomp's default) alone.
    omp_wait_policy: str = ""
    host: str = "127.0.0.1"
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("parallel", "slot_context", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaServerSpec.{name} must be at least 1, got {getattr(self, name)}")

    def command(self, port: int) -> list[str]:
        # -c is the whole KV cache; without --kv-unified llama-server splits it evenly into the slots.
        return [str(self.server), "--model", str(self.model), "--host", self.host, "--port", str(port),
                "--parallel", str(self.parallel), "--ctx-size", str(self.parallel * self.slot_context),
                "--threads", str(self.threads), "--threads-batch", str(self.threads), "--no-webui"]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.omp_wait_policy:
            env["OMP_WAIT_POLICY"] = self.omp_wait_policy
        return env


def slot_context(max_prompt_len: int, max_output_len: int) -> int:
    """Context a slot needs: llama-server stops a sequence one token before its slot is full, so one more."""
    return max_prompt_len + max_output_len + 1


class LlamaServerDied(RuntimeError):
    """llama-server exited while it was being started or used: ``reason`` says how, the message adds its log."""

    def __init__(self, reason: str, log_path: Path, tail: str) -> None:
        super().__init__(f"{reason} (log {log_path}):\n{tail}")
        self.reason = reason


class LlamaServer:
    """`with LlamaServer(spec) as s: s.base_url` — the server is stopped on exit; its log is kept in `log_path`."""

    def __init__(self, spec: LlamaServerSpec) -> None:
        self.spec = spec
        self.port = free_port(spec.host)
        self.log_path = Path(tempfile.mkdtemp(prefix="llama-server-")) / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def _check_alive(self) -> None:
        assert self._proc is not None
        code = self._proc.poll()
        if code is not None:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
            raise LlamaServerDied(f"llama-server exited with {how}", self.log_path, self.tail())

    def __enter__(self) -> LlamaServer:
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(self.spec.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                          env=self.spec.env())
        try:
            if not wait_http_ok(f"{self.base_url}/health", self.spec.start_timeout_s, self._check_alive):
                raise RuntimeError(f"llama-server was not ready after {self.spec.start_timeout_s} s "
                                   f"(log {self.log_path}):\n{self.tail()}")
        except BaseException:
            terminate(self._proc, 10)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._proc is not None:
            terminate(self._proc, 10)
