"""Ctrl-C on `llmserve up` in a terminal: the services stop in order, the worker's drain completes.

A terminal sends SIGINT to its whole foreground process group. The services run in sessions of
their own, so only `up` receives it and stops them in order: the worker drains while the
scheduler and Redis are still there to report it drained, rather than every process dying at
once and the worker waiting out its drain timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.redis_server import free_port

# Well below the worker's default --drain-timeout (30 s): an exit this fast means the drain completed.
STOP_WITHIN_S = 20.0


def test_ctrl_c_stops_up_in_order(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "llmserve", "up", "--model", str(tiny_llama_dir), "--port", str(free_port()),
           "--log-dir", str(tmp_path), "--num-threads", "1"]
    # Its own process group, standing for the terminal's foreground job.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert "llmserve is up" in banner, banner + proc.stdout.read()
        os.killpg(proc.pid, signal.SIGINT)
        started = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for role in ("worker", "scheduler"):
            print(f"--- {role}.log (tail)\n" + "\n".join((tmp_path / f"{role}.log").read_text().splitlines()[-8:]))
    worker_log = (tmp_path / "worker.log").read_text()
    assert proc.returncode == 0, out
    assert "stopping" in out
    assert any(line.rstrip().endswith(" drained") for line in worker_log.splitlines()), worker_log[-2000:]
    assert "drain timed out" not in worker_log, worker_log[-2000:]
    assert took < STOP_WITHIN_S, f"took {took:.1f} s to stop"
