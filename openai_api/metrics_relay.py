"""The engine's Prometheus series on the HTTP front's /metrics, as vLLM's API server serves them on its port.

The engine's series live in other processes (the scheduler's `vllm:*` and `llmserve:engine_*`, the worker's
`llmserve:worker_*`), each on its own --metrics-port. A front started with `--engine-metrics URL` fetches
those endpoints when it is scraped and serves their families after its own, merged by name (two scheduler
replicas export the same families; an exposition may declare each family once). A source that does not
answer within the timeout is left out of that scrape and `llmserve:metrics_relay_up{source}` says so, as
Prometheus' own `up` does for a target: a scrape never fails because an engine process is slow or gone.

Where Prometheus can reach the scheduler and worker pods itself (Kubernetes: deploy/k8s annotates them),
scrape them directly; the relay is for one host, where a client of vLLM expects one /metrics.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 2.0


class _Families:
    """A collector that yields fixed families (generate_latest renders collectors of a registry)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - operator-given URLs
        return response.read().decode("utf-8")


async def _scrape(url: str, timeout_s: float) -> str | None:
    try:
        return await asyncio.to_thread(_fetch, url, timeout_s)
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _parse(text: str) -> list[Metric] | None:
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:  # not a Prometheus text exposition (a wrong URL answering 200)
        return None


def merge(*sources: list[Metric]) -> list[Metric]:
    """Every source's families in order, a family that several sources export declared once."""
    families: dict[str, Metric] = {}
    for source in sources:
        for family in source:
            known = families.get(family.name)
            if known is None:
                families[family.name] = family
            elif known.type == family.type:
                known.samples.extend(family.samples)
            # The same name with another type would make the exposition invalid: the first one is kept.
    return list(families.values())


async def relayed_exposition(own: CollectorRegistry, sources: list[str], timeout_s: float = TIMEOUT_S) -> bytes:
    """The text exposition of ``own`` and of every source that answered, with one `up` series per source."""
    texts = await asyncio.gather(*(_scrape(url, timeout_s) for url in sources))
    parsed = [None if text is None else _parse(text) for text in texts]
    up = GaugeMetricFamily("llmserve:metrics_relay_up",
                           "1 when the engine metrics endpoint answered this scrape, else 0.", labels=["source"])
    for url, families in zip(sources, parsed):
        up.add_metric([url], 0.0 if families is None else 1.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merge(list(own.collect()), *(f for f in parsed if f is not None), [up])))
    return generate_latest(registry)
