"""The lifeline's watcher: an owner that ends without "bye" has its processes stopped in stop()'s order, each
waited for; after "bye" nothing is touched; one that ignores SIGTERM is killed after the grace period."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.lifeline import STOP_ORDER, watch

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the lifeline needs pidfds (Linux 5.3+)")

# A process that, on SIGTERM, takes a moment and then appends its role to a file: the file's order is the order the
# watcher stopped them in only if it waited for each before the next.
_SERVICE = """
import signal, sys, time
def stop(signum, frame):
    time.sleep(0.2)
    with open(sys.argv[1], "a") as out:
        out.write(sys.argv[2] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(60)
"""
_DEADLINE_S = 60.0


def _alive(proc: subprocess.Popen[str]) -> bool:
    return proc.poll() is None


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _service(procs: list[subprocess.Popen[str]], out: Path, role: str, ignore_term: bool = False) -> int:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n" \
           "while True:\n    time.sleep(60)\n" if ignore_term else _SERVICE
    proc = subprocess.Popen([sys.executable, "-c", code, str(out), role], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # its handler is in place
    procs.append(proc)
    return proc.pid


def _pipe_with(lines: list[str]) -> int:
    """A pipe holding `lines` whose write end is closed: the watcher reads them, then end-of-file."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, "".join(lines).encode())
    os.close(write_fd)
    return read_fd


def test_an_unclean_end_stops_every_process_in_order(tmp_path: Path, started: list[subprocess.Popen[str]]) -> None:
    out = tmp_path / "stopped"
    # Started in the cluster's order, not the stopping order.
    lines = [f"+{_service(started, out, role)} {role}\n" for role in ("redis", "worker", "scheduler", "openai")]
    stopped = watch(_pipe_with(lines), owner=os.getpid(), grace_s=_DEADLINE_S)
    assert stopped == list(STOP_ORDER)
    assert out.read_text().split() == list(STOP_ORDER)
    for proc in started:
        assert proc.wait(timeout=_DEADLINE_S) == 0


def test_bye_leaves_everything_running(tmp_path: Path, started: list[subprocess.Popen[str]]) -> None:
    pid = _service(started, tmp_path / "stopped", "worker")
    assert watch(_pipe_with([f"+{pid} worker\n", "bye\n"]), owner=os.getpid()) == []
    assert _alive(started[0])
    assert not (tmp_path / "stopped").exists()


def test_a_process_that_ignores_sigterm_is_killed(tmp_path: Path, started: list[subprocess.Popen[str]]) -> None:
    pid = _service(started, tmp_path / "stopped", "worker", ignore_term=True)
    assert watch(_pipe_with([f"+{pid} worker\n"]), owner=os.getpid(), grace_s=0.5) == ["worker"]
    assert started[0].wait(timeout=_DEADLINE_S) == -signal.SIGKILL


def test_a_process_that_already_exited_is_left_alone(tmp_path: Path, started: list[subprocess.Popen[str]]) -> None:
    """A service that exited before the owner did (a fault test's kill): not signalled, and its pid, should it be
    reused, not taken for it (the watcher holds the process, not the number)."""
    pid = _service(started, tmp_path / "stopped", "worker")
    started[0].kill()
    # Not reaped: a zombie, as a service the owner has not waited for yet; the pidfd reads as exited.
    deadline = time.monotonic() + _DEADLINE_S
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert watch(_pipe_with([f"+{pid} worker\n"]), owner=os.getpid()) == []


_OWNER = """
import os, subprocess, sys
from pathlib import Path
from llmserve.lifeline import Lifeline
lifeline = Lifeline(Path(sys.argv[1]))
child = subprocess.Popen(["sleep", "600"], start_new_session=True)
lifeline.watch(child.pid, "worker")
print(child.pid, lifeline.watcher_pid, flush=True)
sys.stdin.read()
"""


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("end", [signal.SIGKILL, signal.SIGTERM])
def test_an_owner_killed_has_its_processes_stopped(tmp_path: Path, end: signal.Signals) -> None:
    """The whole path: an owner process ended by a signal it does not handle (its stop() never runs)."""
    log = tmp_path / "lifeline.log"
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(log)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert owner.stdout is not None
    child, watcher = (int(word) for word in owner.stdout.readline().split())
    try:
        assert _pid_alive(child)
        owner.send_signal(end)
        owner.wait(timeout=_DEADLINE_S)
        deadline = time.monotonic() + _DEADLINE_S
        while (_pid_alive(child) or _pid_alive(watcher)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(child), log.read_text()
        assert not _pid_alive(watcher), log.read_text()
        text = log.read_text()
        assert f"(pid {owner.pid}) ended without stopping it: stopping worker" in text, text
        assert f"stopping the worker (pid {child})" in text, text
    finally:
        for pid in (child, watcher):
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
