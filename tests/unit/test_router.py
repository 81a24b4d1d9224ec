"""The routing policy (pure): least loaded, prefix affinity within a load slack, spread ties."""

from __future__ import annotations

import pytest

from scheduler_service.router import RouteCandidate, choose


def test_least_loaded_wins_without_prefix_matches() -> None:
    candidates = [RouteCandidate("a", 7), RouteCandidate("b", 3), RouteCandidate("c", 5)]
    assert choose(candidates, "r1") == "b"


def test_longest_cached_prefix_wins_within_the_slack() -> None:
    # Least load 10 -> slack 5: "b" (14) is eligible and holds the longest prefix.
    candidates = [RouteCandidate("a", 10, prefix_blocks=1), RouteCandidate("b", 14, prefix_blocks=3),
                  RouteCandidate("c", 12)]
    assert choose(candidates, "r1") == "b"


def test_a_busy_prefix_holder_loses_to_an_idle_worker() -> None:
    # Least load 0 -> slack 2: the holder at 9 live requests is not eligible.
    candidates = [RouteCandidate("a", 9, prefix_blocks=8), RouteCandidate("b", 0)]
    assert choose(candidates, "r1") == "b"


def test_equal_loads_spread_by_request_id() -> None:
    candidates = [RouteCandidate(w, 0) for w in ("a", "b", "c", "d")]
    picks = {choose(candidates, f"req-{i}") for i in range(64)}
    assert picks == {"a", "b", "c", "d"}
    # and a given request id always lands on the same worker
    assert choose(candidates, "req-7") == choose(list(reversed(candidates)), "req-7")


def test_ties_on_prefix_break_by_load() -> None:
    candidates = [RouteCandidate("a", 4, prefix_blocks=2), RouteCandidate("b", 3, prefix_blocks=2),
                  RouteCandidate("c", 3)]
    assert choose(candidates, "r") == "b"


def test_choose_needs_a_candidate() -> None:
    with pytest.raises(ValueError, match="at least one candidate"):
        choose([], "r")
