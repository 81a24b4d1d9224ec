"""Ctrl-C on `llmserve up` in a terminal: the services stop in order, the worker's drain completes. SIGTERM during
`up`'s start-up, or during `llmserve demo`, stops the services it started.

A terminal sends SIGINT to its whole foreground process group. The services run in sessions of
their own, so only `up` receives it and stops them in order: the worker drains while the
scheduler and Redis are still there to report it drained, rather than every process dying at
once and the worker waiting out its drain timeout. A second Ctrl-C kills what is left at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from shared.redis_server import free_port
from tests.e2e.up_process import alive, lifeline_watcher, services_of, up

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
        # stop() waits for each service; the reaping may lag a little.
        assert _gone_within(services, deadline_s=30) == []


def _gone_within(pids: list[int], deadline_s: float) -> list[int]:
    """Waits until none of `pids` runs; the ones still running at the deadline."""
    deadline = time.monotonic() + deadline_s
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@contextlib.contextmanager
def _running(cmd: list[str]) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """`cmd` in a session of its own, and a list for the pids of its children; what is left of either is killed
    afterwards."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started: list[int] = []
    try:
        yield proc, started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _sigterm_once_started(cmd: list[str], services: int) -> tuple[int, str, list[int]]:
    """Runs `cmd` and SIGTERMs it once its `services` children run; returns its exit code, its output and those of
    its children (the lifeline's watcher too) still running when it exited."""
    with _running(cmd) as (proc, started):
        deadline = time.monotonic() + 120
        while len(services_of(proc.pid)) < services and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        started += [*services_of(proc.pid), lifeline_watcher(proc.pid)]
        assert len(started) == services + 1, (started, proc.poll())
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out, [pid for pid in started if alive(pid)]


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


def test_sigkill_of_up_still_stops_its_services(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`up` killed outright (SIGKILL, the OOM killer) runs no handler of its own: the lifeline's watcher sees it go
    and stops the services in stop()'s order, the worker draining while the scheduler still runs."""
    with up(tiny_llama_dir, tmp_path) as running:
        watcher = lifeline_watcher(running.proc.pid)
        running.proc.kill()
        running.proc.wait(timeout=60)
        # The watcher waits up to 15 s for each of three services before it kills one.
        left = _gone_within([*running.services, watcher], deadline_s=120)
    lifeline_log = (tmp_path / "lifeline.log").read_text()
    assert left == [], lifeline_log
    assert f"(pid {running.proc.pid}) ended without stopping it: stopping worker, scheduler, redis" in lifeline_log
    assert "killing" not in lifeline_log, lifeline_log
    worker_log = (tmp_path / "worker.log").read_text()
    assert any(line.rstrip().endswith(" drained") for line in worker_log.splitlines()), worker_log[-2000:]


_LIBRARY_OWNER = """
import sys, time
from llmserve.local_cluster import ClusterSpec, LocalCluster
cluster = LocalCluster(ClusterSpec(model=sys.argv[1], log_dir=sys.argv[2], worker_args=["--num-threads", "1"]))
cluster.start()
print("started", flush=True)
time.sleep(600)
"""


def test_a_script_ended_by_sigterm_leaves_no_service_running(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A program using the local cluster as a library (the benchmarks, the offline API's services mode) installs
    no signal handler: a SIGTERM (a job's time limit) ends it at once, and the watcher stops what it started."""
    with _running([sys.executable, "-c", _LIBRARY_OWNER, str(tiny_llama_dir), str(tmp_path)]) as (proc, started):
        assert proc.stdout is not None
        assert proc.stdout.readline() == "started\n", proc.stdout.read()
        started += [*services_of(proc.pid), lifeline_watcher(proc.pid)]
        assert len(started) == 4, started  # Redis, the worker, the scheduler, the watcher
        proc.terminate()
        assert proc.wait(timeout=60) == -signal.SIGTERM
        # The watcher gives each service up to 15 s.
        left = _gone_within(started, deadline_s=120)
    lifeline_log = (tmp_path / "lifeline.log").read_text()
    assert left == [], lifeline_log
    assert "ended without stopping it: stopping worker, scheduler, redis" in lifeline_log, lifeline_log
