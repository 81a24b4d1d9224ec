"""The workload split benchmark's step kinds and sums, and the process ids it reads CPU time from."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.workload_split import KINDS, step_kind, totals_by_kind
from shared.redis_server import RedisServer


@pytest.mark.parametrize(("prefill", "decode", "kind"), [
    (256, 0, "prefill"),
    (1, 0, "prefill"),
    (200, 56, "prefill + decodes"),
    (1, 1, "prefill + decodes"),
    (0, 64, "decodes of 48+"),
    (0, 48, "decodes of 48+"),
    (0, 47, "decodes of 16-47"),
    (0, 16, "decodes of 16-47"),
    (0, 15, "decodes of 1-15"),
    (0, 1, "decodes of 1-15"),
])
def test_a_step_is_of_the_kind_its_tokens_make_it(prefill: int, decode: int, kind: str) -> None:
    assert step_kind(prefill, decode) == kind


def test_totals_sum_each_kinds_steps_tokens_and_seconds() -> None:
    totals = totals_by_kind([(256, 0, 0.15, 0.14), (192, 64, 0.2, 0.18), (0, 64, 0.07, 0.06), (0, 63, 0.06, 0.05),
                             (0, 3, 0.02, 0.01)])
    assert list(totals) == KINDS
    assert (totals["decodes of 48+"].steps, totals["decodes of 48+"].tokens) == (2, 127)
    assert totals["decodes of 48+"].seconds == pytest.approx(0.13)
    assert totals["decodes of 48+"].worker_s == pytest.approx(0.11)
    assert (totals["prefill"].steps, totals["prefill + decodes"].tokens, totals["decodes of 1-15"].tokens) == (1, 256, 3)
    assert totals["decodes of 16-47"].steps == 0


def test_a_redis_server_names_its_process() -> None:
    server = RedisServer()
    with pytest.raises(RuntimeError, match="not been launched"):
        _ = server.pid
    with server:
        assert "redis-server" in Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
