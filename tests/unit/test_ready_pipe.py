"""The ready pipe between LocalCluster and its services: notices arrive whole, an exit reads as one."""

from __future__ import annotations

import os
import time

import pytest

from llmserve.ready_pipe import READY, SERVING, PipeClosedError, ReadyNotifier, ReadyPipes
from shared.startup_timer import Phase, StartupReport

# Generous: the notices are written before the wait starts, reading them takes microseconds.
DEADLINE_S = 10.0


def test_notices_arrive_with_their_reports() -> None:
    pipes = ReadyPipes()
    fd = pipes.open("scheduler")
    try:
        notifier = ReadyNotifier(fd)
        ready = StartupReport(2.0, (Phase("imports", 1.5),))
        notifier.notify(READY, ready)
        assert pipes.wait([("scheduler", READY)], time.monotonic() + DEADLINE_S)
        notice = pipes.notice("scheduler", READY)
        assert notice is not None and notice.report == ready
        assert pipes.notice("scheduler", SERVING) is None
        notifier.notify(SERVING, StartupReport(2.1, (Phase("imports", 1.5), Phase("first lease", 0.1))))
        assert pipes.wait([("scheduler", SERVING)], time.monotonic() + DEADLINE_S)
    finally:
        os.close(fd)
        pipes.close_all()


def test_a_closed_pipe_is_an_exit_and_a_quiet_one_times_out() -> None:
    pipes = ReadyPipes()
    worker_fd, scheduler_fd = pipes.open("worker"), pipes.open("scheduler")
    try:
        # Nothing written: the wait ends at its deadline, not before.
        deadline = time.monotonic() + 0.05
        assert not pipes.wait([("worker", READY)], deadline)
        assert time.monotonic() >= deadline
        os.close(scheduler_fd)  # the scheduler exits while the worker is awaited
        with pytest.raises(PipeClosedError) as closed:
            pipes.wait([("worker", READY)], time.monotonic() + DEADLINE_S)
        assert closed.value.role == "scheduler"
    finally:
        os.close(worker_fd)
        pipes.close_all()


def test_a_malformed_line_is_skipped() -> None:
    pipes = ReadyPipes()
    fd = pipes.open("worker")
    try:
        os.write(fd, b"not json\n")
        ReadyNotifier(fd).notify(READY, StartupReport(1.0))
        assert pipes.wait([("worker", READY)], time.monotonic() + DEADLINE_S)
    finally:
        os.close(fd)
        pipes.close_all()


def test_a_notifier_whose_reader_is_gone_stays_quiet() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        ReadyNotifier(write_fd).notify(READY, StartupReport(1.0))  # EPIPE: logged, not raised
    finally:
        os.close(write_fd)
