"""End to end with every security setting on: Redis + worker + scheduler + HTTP front as real processes.

    client ──TLS + bearer token──▶ scheduler ──mutual TLS──▶ worker
    HTTP client ──API key──▶ front ──TLS + token──▶ scheduler
    scheduler, worker ──AUTH──▶ Redis (requirepass)

Two CAs: "public" signs the scheduler's serving certificate (what clients trust), "internal" signs
the worker's serving certificate and the scheduler's client certificate (the worker trusts only it).
A third, "rogue", stands for anyone else. Secrets reach the services through files and the environment;
the test then checks that none of them shows in a log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from shared.auth import INVALID_MESSAGE, MISSING_MESSAGE, token_interceptors
from shared.tls import ClientTLS, open_channel
from tests.certs import CA, CertFiles, make_ca

TOKEN = "tok-e2e-7c1d0f5a9b3e"
API_KEY = "key-e2e-4a8f2e6c0d1b"
REDIS_PASSWORD = "pw-e2e-91be77c3d2f0"
PROMPT = [5, 17, 42, 99, 7, 3]


@dataclass(frozen=True)
class Pki:
    public: CA
    internal: CA
    rogue: CA
    scheduler: CertFiles  # serves the public API (public CA)
    worker: CertFiles  # serves the Worker API (internal CA)
    scheduler_client: CertFiles  # the scheduler's certificate towards the workers (internal CA)
    rogue_client: CertFiles  # a client certificate from a CA the worker does not trust


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    public, internal, rogue = make_ca(root, "public"), make_ca(root, "internal"), make_ca(root, "rogue")
    return Pki(public, internal, rogue, public.issue("scheduler"), internal.issue("worker"),
               internal.issue("scheduler-client", client=True), rogue.issue("intruder", client=True))


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("secrets")
    files = {"token": root / "token", "api_key": root / "api-key"}
    files["token"].write_text(TOKEN + "\n")
    files["api_key"].write_text(API_KEY)
    for path in files.values():
        path.chmod(0o600)
    return files


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, pki: Pki, secret_files: dict[str, Path]) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--num-threads", "1",
                     "--log-level", "DEBUG",
                     "--tls-cert-file", str(pki.worker.cert), "--tls-key-file", str(pki.worker.key),
                     "--tls-client-ca-file", str(pki.internal.cert)],
        scheduler_args=["--log-level", "DEBUG",
                        "--tls-cert-file", str(pki.scheduler.cert), "--tls-key-file", str(pki.scheduler.key),
                        "--auth-token-file", str(secret_files["token"]),
                        "--worker-tls-ca-file", str(pki.internal.cert),
                        "--worker-tls-cert-file", str(pki.scheduler_client.cert),
                        "--worker-tls-key-file", str(pki.scheduler_client.key)],
        http_port=0,
        http_args=["--tls-ca-file", str(pki.public.cert), "--auth-token-file", str(secret_files["token"]),
                   "--api-key-file", str(secret_files["api_key"])],
        tls_ca_file=str(pki.public.cert),
        redis_password=REDIS_PASSWORD,
    )
    with LocalCluster(spec) as c:
        yield c


def _request() -> object:
    return make_request(prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)


def _rpc_error(client: GenerationClient) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        client.generate(_request(), timeout=30)  # type: ignore[arg-type]
    return info.value


def test_a_client_with_the_token_over_tls_generates(cluster: LocalCluster, pki: Pki) -> None:
    with GenerationClient(cluster.address, ClientTLS(str(pki.public.cert)), TOKEN) as client:
        out = client.generate(_request(), timeout=60)  # type: ignore[arg-type]
        assert len(out.token_ids) == 4 and not out.error
        assert client.model_info().max_model_len == 256


def test_a_client_without_the_right_token_is_unauthenticated(cluster: LocalCluster, pki: Pki) -> None:
    for token, message in (("", MISSING_MESSAGE), ("not-the-token", INVALID_MESSAGE)):
        with GenerationClient(cluster.address, ClientTLS(str(pki.public.cert)), token) as client:
            err = _rpc_error(client)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, token  # type: ignore[attr-defined]
            assert err.details() == message  # type: ignore[attr-defined]


def test_plaintext_and_untrusting_clients_cannot_connect(cluster: LocalCluster, pki: Pki) -> None:
    # No wait_for_ready (GenerationClient's default): a failed handshake ends the call with UNAVAILABLE.
    for tls in (None, ClientTLS(str(pki.rogue.cert))):
        with open_channel(cluster.address, tls, interceptors=token_interceptors(TOKEN, aio=False)) as channel:
            with pytest.raises(grpc.RpcError) as info:
                generation_pb2_grpc.GenerationStub(channel).ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, tls  # type: ignore[attr-defined]


def test_the_cli_client_sends_the_token(cluster: LocalCluster, pki: Pki, secret_files: dict[str, Path]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
    base = [sys.executable, "-m", "llmserve", "generate", "--address", cluster.address, "--prompt", "hello",
            "--max-tokens", "3", "--ignore-eos", "--tls-ca-file", str(pki.public.cert), "--timeout", "60"]
    ok = subprocess.run([*base, "--auth-token-file", str(secret_files["token"])], env=env, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "completion tokens: 3" in ok.stdout
    refused = subprocess.run(base, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def _describe_worker(cluster: LocalCluster, tls: ClientTLS | None) -> worker_pb2.WorkerDescription:
    with open_channel(cluster.worker_address, tls) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)


def test_the_worker_admits_only_certificates_from_its_ca(cluster: LocalCluster, pki: Pki) -> None:
    trusted = ClientTLS(str(pki.internal.cert), str(pki.scheduler_client.cert), str(pki.scheduler_client.key))
    assert _describe_worker(cluster, trusted).block_size == 16  # the scheduler's certificate works
    for tls in (None,  # plaintext
                ClientTLS(str(pki.internal.cert)),  # TLS without a client certificate
                ClientTLS(str(pki.internal.cert), str(pki.rogue_client.cert), str(pki.rogue_client.key))):
        with pytest.raises(grpc.RpcError) as info:
            _describe_worker(cluster, tls)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, tls  # type: ignore[attr-defined]


def test_the_http_front_requires_its_api_key(cluster: LocalCluster) -> None:
    assert cluster.http_url is not None
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
    with httpx.Client(base_url=cluster.http_url, timeout=60) as http:
        assert http.get("/health").status_code == 200  # probes need no key
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = http.post("/v1/completions", json=body, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        models = http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        ok = http.post("/v1/completions", json={**body, "model": models["data"][0]["id"]},
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 3


def test_redis_requires_the_password(cluster: LocalCluster) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(cluster.redis_url).ping()
    with redis.Redis.from_url(cluster.redis_url, password=REDIS_PASSWORD) as client:
        assert client.ping()
        assert client.dbsize() > 0, "the services keep their state in this Redis"


def test_no_secret_reaches_a_log(cluster: LocalCluster, pki: Pki) -> None:
    # Runs last in the module: every test above has exercised the services (and their refusals).
    key_lines = {line for files in (pki.scheduler, pki.worker, pki.scheduler_client)
                 for line in files.key.read_text().splitlines() if line and not line.startswith("-----")}
    for role in ("scheduler", "worker", "openai"):
        log = cluster.log_path(role).read_text(errors="replace")
        assert log, role
        for secret in (TOKEN, API_KEY, REDIS_PASSWORD, "not-the-token", "PRIVATE KEY", *key_lines):
            assert secret not in log, (role, secret[:6])
    assert "refused /llmserve.v1.Generation/Generate" in cluster.log_path("scheduler").read_text()
