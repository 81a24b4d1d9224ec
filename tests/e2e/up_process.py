"""`llmserve up` as a terminal runs it, for the tests of its start-up and its Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.redis_server import free_port


@dataclass
class UpProcess:
    """The running `up`, its services' pids, and what it printed up to its banner (the banner last)."""

    proc: subprocess.Popen[str]
    services: list[int]
    lines: list[str]


def children(pid: int) -> list[int]:
    """The direct children of a process (Linux)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def services_of(pid: int) -> list[int]:
    """The local cluster's processes started by `pid`: its children but the lifeline's watcher."""
    return [child for child in children(pid) if b"llmserve.lifeline" not in _cmdline(child)]


def lifeline_watcher(pid: int) -> int:
    """The lifeline's watcher that `pid` started (llmserve/lifeline.py)."""
    return next(child for child in children(pid) if b"llmserve.lifeline" in _cmdline(child))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # exited meanwhile
        return b""


def alive(pid: int) -> bool:
    """Whether pid is still one of the cluster's processes (a pid may have been reused)."""
    cmdline = _cmdline(pid)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z" and (b"llmserve" in cmdline or b"redis" in cmdline)


@contextlib.contextmanager
def up(model_dir: Path, log_dir: Path) -> Iterator[UpProcess]:
    """`llmserve up` in a process group of its own (the terminal's foreground job), once it is up."""
    cmd = [sys.executable, "-m", "llmserve", "up", "--model", str(model_dir), "--port", str(free_port()),
           "--log-dir", str(log_dir), "--num-threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    services: list[int] = []
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        # Up to the banner (or the end of the output, when up failed).
        while not lines or ("llmserve is up" not in lines[-1] and lines[-1]):
            lines.append(proc.stdout.readline())
        services = services_of(proc.pid)  # Redis, the worker, the scheduler: in sessions of their own
        assert "llmserve is up" in lines[-1], "".join(lines) + proc.stdout.read()
        assert len(services) == 3, services
        yield UpProcess(proc, services, lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in services:  # whatever a failed run left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for role in ("worker", "scheduler"):
            print(f"--- {role}.log (tail)\n" + "\n".join((log_dir / f"{role}.log").read_text().splitlines()[-8:]))
