"""shared/processes.py signals_deferred: a stop signal during a child's start comes after the child is held."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from shared.processes import signals_deferred


class _Stopped(BaseException):
    pass


def _raise(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def test_a_signal_in_the_block_is_delivered_after_it_and_the_handlers_are_restored() -> None:
    previous = signal.signal(signal.SIGTERM, _raise)
    interrupt = signal.getsignal(signal.SIGINT)  # Python's default, or ignored (a process started by nohup)
    try:
        done = []
        with pytest.raises(_Stopped):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # a second one is not delivered twice
                done.append("the block ran to its end")
        # What the block made (a child process, in use) was in the owner's hands before the handler raised.
        assert done == ["the block ran to its end"]
        assert signal.getsignal(signal.SIGTERM) is _raise
        assert signal.getsignal(signal.SIGINT) is interrupt
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_a_signal_nothing_is_delivered() -> None:
    came = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: came.append(signum))
    try:
        with signals_deferred():
            pass
        assert came == []
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_off_the_main_thread_the_block_runs_as_is() -> None:
    # signal.signal works only in the main thread: elsewhere the block must still run, without touching handlers.
    ran = []

    def body() -> None:
        with signals_deferred():
            ran.append(True)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert ran == [True]


def test_an_ignored_signal_stays_ignored() -> None:
    # Not held, so not turned into a caught one that the child would then get back as the default (nohup's SIGINT).
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals_deferred():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
