"""The OpenAI front on its own over HTTPS with client certificates, and CORS for browser pages: a real
`llmserve openai` process (its scheduler is not needed for what is checked here: /version, preflights)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shared.redis_server import free_port
from tests.certs import CA, CertFiles, make_ca

ORIGIN = "https://app.example.com"
API_KEY = "key-https-5d2c9e"
START_TIMEOUT_S = 120  # the front starts in ~2 s on an idle machine


@dataclass(frozen=True)
class Front:
    url: str
    ca: CA
    client: CertFiles
    log: Path


def _context(ca: CA, client: CertFiles | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.cert))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    root = tmp_path_factory.mktemp("front-pki")
    ca = make_ca(root, "front")
    server, client = ca.issue("front"), ca.issue("browser", client=True)
    key_file = root / "api-key"
    key_file.write_text(API_KEY)
    port = free_port()
    log = (root / "front.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "llmserve", "openai", "--host", "127.0.0.1", "--port", str(port),
         "--scheduler", f"127.0.0.1:{free_port()}", "--http-tls-cert-file", str(server.cert),
         "--http-tls-key-file", str(server.key), "--http-tls-client-ca-file", str(ca.cert),
         "--allowed-origins", ORIGIN, "--api-key-file", str(key_file)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, (root / "front.log").read_text()
            try:
                if httpx.get(f"{url}/version", verify=_context(ca, client), timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the front did not answer in {START_TIMEOUT_S}s"
            time.sleep(0.2)
        yield Front(url, ca, client, root / "front.log")
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


def test_https_with_a_client_certificate(front: Front) -> None:
    reply = httpx.get(f"{front.url}/version", verify=_context(front.ca, front.client), timeout=30)
    assert reply.status_code == 200 and reply.json()["version"]
    # Without a client certificate the handshake is refused; plain HTTP gets no answer from the TLS port.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{front.url}/version", verify=_context(front.ca, None), timeout=30)
    with pytest.raises(httpx.TransportError):
        httpx.get(front.url.replace("https://", "http://") + "/version", timeout=30)


def test_the_start_up_line_says_how_the_front_serves(front: Front) -> None:
    line = next(line for line in front.log.read_text().splitlines() if "OpenAI-compatible API for" in line)
    assert line.endswith(f"; HTTPS with client certificates; browser origins {ORIGIN}"), line


def test_browser_preflights_and_answers_carry_cors_headers(front: Front) -> None:
    with httpx.Client(verify=_context(front.ca, front.client), timeout=30) as http:
        # A preflight carries no Authorization header: it is answered before the API key is checked.
        preflight = http.options(f"{front.url}/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        refused = http.options(f"{front.url}/v1/chat/completions", headers={
            "Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        # The answers themselves: the origin allowed, the request id readable by the page; the key still checked.
        answer = http.get(f"{front.url}/version", headers={"Origin": ORIGIN, "X-Request-Id": "r-1"})
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        assert answer.headers["x-request-id"] == "r-1"
        assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()
        unauthorized = http.post(f"{front.url}/v1/completions", json={"prompt": "hi"}, headers={"Origin": ORIGIN})
        assert unauthorized.status_code == 401
        assert unauthorized.headers["access-control-allow-origin"] == ORIGIN  # the page can read why
