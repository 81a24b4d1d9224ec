"""A service's start-up heap: collection paused while it loads, then one collection and a freeze (in a process of its own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PAUSED_START_UP = """
import gc, weakref
from shared.startup_heap import pause_collection, settle_startup_heap

pause_collection()
assert not gc.isenabled()

class Node:
    pass

garbage = Node()
garbage.self = garbage  # a cycle: only a collection frees it
dead = weakref.ref(garbage)
del garbage
alive = Node()
alive.self = alive

seconds = settle_startup_heap("test")
assert seconds is not None and seconds >= 0, seconds
assert dead() is None, "the start-up's cyclic garbage is collected before the freeze, not frozen with the rest"
assert gc.isenabled() and gc.get_freeze_count() > 0
assert settle_startup_heap("test") is None, "a second settle does nothing"
print("ok")
"""


def test_a_paused_start_up_collects_once_freezes_and_collects_again() -> None:
    done = subprocess.run([sys.executable, "-c", _PAUSED_START_UP], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_a_process_that_never_paused_keeps_its_collector_as_it_was() -> None:
    # The tests and the offline API start services in-process: nothing of their heap may be frozen.
    code = ("import gc; from shared.startup_heap import settle_startup_heap; "
            "assert settle_startup_heap('test') is None; assert gc.get_freeze_count() == 0 and gc.isenabled(); "
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
