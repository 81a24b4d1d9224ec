"""Shared fixtures: the default model, tiny random models, a real Redis."""

from __future__ import annotations

from shared.omp import prefer_sleeping_threads

# Before anything imports torch: the tests share two cores with the services they start.
prefer_sleeping_threads()

from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.hypothesis_profiles  # noqa: F401  (loads the profile before any test module builds settings)
from llmserve.local_cluster import LocalCluster
from shared.default_model import prepare_default_model
from shared.redis_server import RedisServer
from tests.tiny_models import build_tiny_llama


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct); converted on first use."""
    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that ran processes (a fixture with `pods`, as ManifestCluster, or a LocalCluster) reports
    their last log lines.

    A fault in one service usually shows only as a symptom in another (a client's deadline), so the
    services' own words are what tells the cause.
    """
    report = yield
    if report.failed and call.when == "call":
        for value in getattr(item, "funcargs", {}).values():
            for name, pod in (getattr(value, "pods", None) or {}).items():
                report.sections.append((f"log of {name} (last 80 lines)", pod.tail(80)))
            if isinstance(value, LocalCluster):
                for role, tail in value.log_tails(80).items():
                    report.sections.append((f"log of the {role} (last 80 lines)", tail))
    return report


@pytest.fixture()
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server process on a free port."""
    with RedisServer() as server:
        yield server
