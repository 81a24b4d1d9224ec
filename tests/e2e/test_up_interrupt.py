"""Ctrl-C on `llmserve up` in a terminal: the services stop in order, the worker's drain completes. SIGTERM during
`up`'s start-up, or during `llmserve demo`, stops the services it started.

A terminal sends SIGINT to its whole foreground process group. The services run in sessions of
their own, so only `up` receives it and stops them in order: the worker drains while the
scheduler and Redis are still there to report it drained, rather than every process dying at
once and the worker waiting out its drain timeout. A second Ctrl-C kills what is left at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.redis_server import free_port
from tests.e2e.up_process import alive, children, up

# Well below the worker's default --drain-timeout (30 s): an exit this fast means the drain completed.
STOP_WITHIN_S = 20.0


def test_ctrl_c_stops_up_in_order(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with up(tiny_llama_dir, tmp_path) as running:
        proc = running.proc
        os.killpg(proc.pid, signal.SIGINT)
        started = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - started
    worker_log = (tmp_path / "worker.log").read_text()
    assert proc.returncode == 0, out
    assert "stopping" in out
    assert any(line.rstrip().endswith(" drained") for line in worker_log.splitlines()), worker_log[-2000:]
    assert "drain timed out" not in worker_log, worker_log[-2000:]
    assert took < STOP_WITHIN_S, f"took {took:.1f} s to stop"


def test_a_second_ctrl_c_kills_what_is_left(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with up(tiny_llama_dir, tmp_path) as running:
        proc, services = running.proc, running.services
        # A frozen worker would hold the orderly stop for its whole grace period.
        worker = next(pid for pid in services if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(worker, signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.stdout is not None
        assert "stopping" in proc.stdout.readline()
        os.killpg(proc.pid, signal.SIGINT)
        # Well within the 15 s the orderly stop would give the frozen worker.
        proc.communicate(timeout=10)
        time.sleep(0.5)
        assert [pid for pid in services if alive(pid)] == []


def test_up_stops_and_says_so_when_a_service_dies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A worker that dies (a killed tensor-parallel rank takes it down too) leaves nothing to serve: `up` exits
    with status 1 naming it and stops the others, instead of running on with requests that cannot complete."""
    with up(tiny_llama_dir, tmp_path) as running:
        proc, services = running.proc, running.services
        worker = next(pid for pid in services if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(worker, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1, out
        assert "llmserve up: error: the worker exited with code -9" in out
        deadline = time.monotonic() + 30  # stop() waits for each service; the reaping may lag a little
        while [pid for pid in services if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in services if alive(pid)] == []


def _sigterm_once_started(cmd: list[str], services: int) -> tuple[int, str, list[int]]:
    """Runs `cmd` in a session of its own and SIGTERMs it once its `services` children run; returns its exit code,
    its output and the children's pids, which must be gone by then (whatever is left is killed afterwards)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(started := children(proc.pid)) < services and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) == services, (started, proc.poll())
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out, [pid for pid in started if alive(pid)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_during_start_up_stops_what_up_started(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A service manager's SIGTERM while `up` still starts (here its services wait for a Redis that never answers,
    which they would for up to --start-timeout): `up` stops them at once and exits 128 + 15, saying so."""
    cmd = [sys.executable, "-m", "llmserve", "up", "--model", str(tiny_llama_dir), "--port", str(free_port()),
           "--redis-url", f"redis://127.0.0.1:{free_port()}", "--log-dir", str(tmp_path), "--num-threads", "1"]
    # No Redis of up's own: the worker and the scheduler.
    code, out, left = _sigterm_once_started(cmd, services=2)
    assert code == 128 + signal.SIGTERM, out
    assert "llmserve up: stopped by SIGTERM during start-up" in out, out
    assert "llmserve is up" not in out, out
    assert left == []


def test_sigterm_stops_the_demo_and_its_services(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`llmserve demo` (`make run`) ended by SIGTERM (a CI job's timeout) stops the services it started, which run in
    sessions of their own, instead of leaving them running."""
    cmd = [sys.executable, "-m", "llmserve", "demo", "--model", str(tiny_llama_dir), "--log-dir", str(tmp_path)]
    # Redis, the worker and the scheduler started: the worker has yet to load and register, so the demo is still
    # starting (a signal once it streams its answers takes the same way out).
    code, out, left = _sigterm_once_started(cmd, services=3)
    assert code == 128 + signal.SIGTERM, out
    assert "llmserve demo: stopped by SIGTERM" in out, out
    assert left == []
