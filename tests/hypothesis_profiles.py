"""Hypothesis profiles: the same examples on every `make test`, fresh and ten times as many in `make fuzz`.

A test suite that draws new examples on each run blocks a change for a defect it did not touch, found
by chance; a fixed draw judges each change by what it changed. Exploration still runs, on purpose:
`make fuzz` (LLMSERVE_HYPOTHESIS=fuzz) draws fresh examples and prints the blob that replays a failure.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("LLMSERVE_HYPOTHESIS", "repeatable")
_SCALE = {"repeatable": 1, "fuzz": 10}

settings.register_profile("repeatable", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, print_blob=True)
if PROFILE not in _SCALE:
    raise ValueError(f"LLMSERVE_HYPOTHESIS={PROFILE!r}: expected one of {sorted(_SCALE)}.")
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """`n` examples in `make test`, ten times as many in `make fuzz`."""
    return n * _SCALE[PROFILE]
