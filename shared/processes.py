"""Stopping child processes: a clean shutdown first, a kill after a grace period."""

from __future__ import annotations

import subprocess


def terminate(proc: subprocess.Popen, grace_s: float) -> None:  # type: ignore[type-arg]
    """SIGTERM, then SIGKILL if it has not exited within grace_s; a no-op for a process that exited."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
