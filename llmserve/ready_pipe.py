"""How a service started by LocalCluster tells it the moment it is ready, and what its start-up took.

LocalCluster hands each service the write end of a pipe (`--ready-fd N`); the service writes one
JSON line per start-up event, with its StartupReport (shared/startup_timer.py):

    {"event": "ready", "report": {...}}     its health answers SERVING from now on
    {"event": "serving", "report": {...}}   the scheduler only: an engine loop owns its worker (first lease)

The read end wakes LocalCluster as soon as a line arrives, and reads end-of-file as soon as the
service exits (it holds the only write end), so neither readiness nor a crash at start-up waits
for a poll period. A line is far below PIPE_BUF, so each write arrives whole.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import time
from collections.abc import Iterable
from dataclasses import dataclass

from shared.startup_timer import StartupReport

log = logging.getLogger(__name__)

READY = "ready"
SERVING = "serving"


class ReadyNotifier:
    """The service's end: `notify(event, report)` writes one line to the inherited descriptor."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def notify(self, event: str, report: StartupReport) -> None:
        line = json.dumps({"event": event, "report": report.to_dict()}) + "\n"
        try:
            os.write(self._fd, line.encode())
        except OSError as exc:  # the reader is gone (`up` killed): nobody is waiting for the news
            log.debug("could not write the %s event to the ready pipe: %s", event, exc)


@dataclass(frozen=True)
class Notice:
    """One event a service reported: when it arrived (time.monotonic()) and the service's own report."""

    event: str
    received: float
    report: StartupReport


class PipeClosedError(RuntimeError):
    """A service's ready pipe reached end-of-file: the service exited (or closed it) before the event."""

    def __init__(self, role: str) -> None:
        super().__init__(f"the {role} closed its ready pipe")
        self.role = role


class ReadyPipes:
    """LocalCluster's ends of the services' pipes, one per role."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._fds: dict[str, int] = {}
        self._buffers: dict[str, bytes] = {}
        self._notices: dict[str, dict[str, Notice]] = {}

    def open(self, role: str) -> int:
        """A new pipe for `role` (replacing any earlier one); returns the write end for the child.

        The caller closes the write end once the child has it: only the child may hold it, or
        the child's exit would never read as end-of-file.
        """
        self.close(role)
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        self._fds[role] = read_fd
        self._buffers[role] = b""
        self._notices[role] = {}
        self._selector.register(read_fd, selectors.EVENT_READ, role)
        return write_fd

    def notice(self, role: str, event: str) -> Notice | None:
        """The event's notice if it has arrived."""
        return self._notices.get(role, {}).get(event)

    def wait(self, wanted: Iterable[tuple[str, str]], deadline: float) -> bool:
        """Reads until every (role, event) in `wanted` has arrived; False at the deadline (time.monotonic()).

        Raises PipeClosedError when any open pipe ends: that service exited, however far the others are.
        """
        wanted = list(wanted)
        while any(self.notice(role, event) is None for role, event in wanted):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in self._selector.select(remaining):
                self._read(key.data, key.fd)
        return True

    def _read(self, role: str, fd: int) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.close(role)
            raise PipeClosedError(role)
        lines = (self._buffers[role] + chunk).split(b"\n")
        self._buffers[role] = lines.pop()
        for line in lines:
            try:
                message = json.loads(line)
                notice = Notice(str(message["event"]), time.monotonic(), StartupReport.from_dict(message["report"]))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignored a malformed line from the %s's ready pipe (%s): %r", role, exc, line[:200])
                continue
            self._notices[role][notice.event] = notice

    def close(self, role: str) -> None:
        """Stops reading `role`'s pipe (a restarted service gets a new one)."""
        fd = self._fds.pop(role, None)
        if fd is not None:
            self._selector.unregister(fd)
            os.close(fd)

    def close_all(self) -> None:
        for role in list(self._fds):
            self.close(role)
