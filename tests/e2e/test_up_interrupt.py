"""Ctrl-C on `llmserve up` in a terminal: the services stop in order, the worker's drain completes.

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

# Well below the worker's default --drain-timeout (30 s): an exit this fast means the drain completed.
STOP_WITHIN_S = 20.0


def children(pid: int) -> list[int]:
    """The direct children of a process (Linux)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Whether pid is still one of the cluster's processes (a pid may have been reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z" and (b"llmserve" in cmdline or b"redis" in cmdline)


@contextlib.contextmanager
def up(tiny_llama_dir: Path, log_dir: Path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """`llmserve up` in a process group of its own (the terminal's foreground job), and its services."""
    cmd = [sys.executable, "-m", "llmserve", "up", "--model", str(tiny_llama_dir), "--port", str(free_port()),
           "--log-dir", str(log_dir), "--num-threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    services: list[int] = []
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        services = children(proc.pid)  # Redis, the worker, the scheduler: in sessions of their own
        assert "llmserve is up" in banner, banner + proc.stdout.read()
        assert len(services) == 3, services
        yield proc, services
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in services:  # whatever a failed run left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for role in ("worker", "scheduler"):
            print(f"--- {role}.log (tail)\n" + "\n".join((log_dir / f"{role}.log").read_text().splitlines()[-8:]))


def test_ctrl_c_stops_up_in_order(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with up(tiny_llama_dir, tmp_path) as (proc, _):
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
    with up(tiny_llama_dir, tmp_path) as (proc, services):
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
