"""A local cluster's services outlive no owner: a small watcher process stops them when the owner dies unclean.

`llmserve up`, `llmserve demo`, the benchmarks and the offline API's services mode start Redis and the services in
sessions of their own (a terminal's Ctrl-C then reaches only the owner, which stops them in order). The owner's
``stop()`` runs on exceptions, at interpreter exit and on the signals `up` and `demo` handle; a SIGKILL, the OOM
killer, or a SIGTERM to a script that handles none ends the owner without it, and left Redis, the worker (its
whole KV cache) and the scheduler running. A library cannot own its caller's signal handlers, and
``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits, which an offline API used from a thread pool would
hit while still serving. So the owner starts one watcher with the read end of a pipe whose write end only the owner
holds::

    owner ──"+<pid> <role>" per process it starts, "bye" once it stopped them──▶ watcher
          (the kernel closes the pipe whatever ends the owner: end-of-file without "bye" = an unclean end)

On that end-of-file the watcher stops what still runs in `stop()`'s order (the OpenAI front, the worker while the
scheduler can still confirm its drain, the scheduler, Redis), SIGTERM then SIGKILL after a grace period, and says
so in its log. It holds each process as a pidfd, not a pid: one that exited long ago (a fault test's kill) is never
confused with a new process given the same number. Without pidfds (not Linux, or a kernel before 5.3) no watcher
runs and the cluster works as before.

Limits: a process is told to the watcher just after `Popen` returns, so an owner killed in that millisecond of a
start-up leaves that one process out; a process the owner forks (``multiprocessing``'s fork) holds the write end
too, and then the watcher acts once both have exited.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.processes import signals_deferred

# The order stop() stops them in (LocalCluster.stop): unknown roles after these.
STOP_ORDER = ("openai", "worker", "scheduler", "redis")
# What a service gets between SIGTERM and SIGKILL: LocalCluster.stop's grace.
GRACE_S = 15.0
_BYE = "bye"
# How long the owner's stop waits for the watcher to read "bye" and exit.
_WATCHER_EXIT_S = 10.0


class Lifeline:
    """The owner's side: starts the watcher, tells it each process, and says "bye" after a clean stop.

    Every method is a no-op once the watcher cannot be reached (it died, or no pidfds here): it is a safety net, and
    the owner's own stop() still stops everything.
    """

    def __init__(self, log_path: Path) -> None:
        self._write_fd: int | None = None
        self._watcher: subprocess.Popen[bytes] | None = None
        if not hasattr(os, "pidfd_open"):
            return
        read_fd, write_fd = os.pipe()  # non-inheritable: no service the owner starts holds the write end
        try:
            with open(log_path, "ab") as log, signals_deferred():
                # A session of its own: the terminal's Ctrl-C goes to the owner, which then stops the cluster itself.
                self._watcher = subprocess.Popen(
                    [sys.executable, "-m", "llmserve.lifeline", str(read_fd), str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(read_fd,),
                    start_new_session=True)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self._write_fd = write_fd

    def watch(self, pid: int, role: str) -> None:
        """The watcher stops `pid` (this `role`) should the owner end without saying bye."""
        self._send(f"+{pid} {role}\n")

    def release(self) -> None:
        """The owner stopped everything itself: the watcher exits without acting."""
        self._send(f"{_BYE}\n")
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        if self._watcher is not None:
            try:
                self._watcher.wait(timeout=_WATCHER_EXIT_S)
            except subprocess.TimeoutExpired:
                self._watcher.kill()
                self._watcher.wait()
            self._watcher = None

    @property
    def watcher_pid(self) -> int | None:
        return None if self._watcher is None else self._watcher.pid

    def _send(self, line: str) -> None:
        if self._write_fd is None:
            return
        try:
            os.write(self._write_fd, line.encode())  # one short write: atomic on a pipe
        except OSError:  # the watcher is gone (killed): go on without it
            os.close(self._write_fd)
            self._write_fd = None


def _say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} llmserve lifeline: {message}", flush=True)


def _exited(pidfd: int) -> bool:
    """Whether the process behind `pidfd` has exited (a pidfd reads as readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def _stop(pidfd: int, pid: int, role: str, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if the process still runs after `grace_s`."""
    if _exited(pidfd):
        return
    _say(f"stopping the {role} (pid {pid})")
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        if not select.select([pidfd], [], [], grace_s)[0]:
            _say(f"the {role} (pid {pid}) still runs after {grace_s:.0f} s: killing it")
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:  # exited meanwhile
        pass


def watch(read_fd: int, owner: int, grace_s: float = GRACE_S) -> list[str]:
    """The watcher: reads the owner's lines until end-of-file; returns the roles it stopped (in order)."""
    held: list[tuple[int, int, str]] = []  # (pidfd, pid, role), in the order the owner started them
    said_bye = False
    pending = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(4096):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line.decode()
                if text == _BYE:
                    said_bye = True
                elif text.startswith("+"):
                    pid_text, _, role = text[1:].partition(" ")
                    try:
                        held.append((os.pidfd_open(int(pid_text)), int(pid_text), role))
                    except ProcessLookupError:  # it exited before this line was read
                        pass
    if said_bye:
        return []
    running = [entry for entry in held if not _exited(entry[0])]
    if not running:
        return []
    rank = {role: i for i, role in enumerate(STOP_ORDER)}
    running.sort(key=lambda entry: rank.get(entry[2], len(STOP_ORDER)))
    _say(f"the process that started this cluster (pid {owner}) ended without stopping it: stopping "
         f"{', '.join(role for _, _, role in running)}")
    for pidfd, pid, role in running:
        _stop(pidfd, pid, role, grace_s)
    _say("stopped")
    return [role for _, _, role in running]


def main(argv: list[str]) -> int:
    # The terminal's signals are the owner's to act on; a SIGTERM (its default action) ends the watcher.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    watch(int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
