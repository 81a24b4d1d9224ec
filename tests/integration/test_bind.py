"""A service's port: a second server on a port already served fails to start, saying why.

gRPC sets SO_REUSEPORT by default, which let a second worker bind a served port and the kernel share the
connections between two processes (and two KV caches); the project's servers turn it off.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from shared import grpc_server
from shared.tls import BindError, bind, listen_socket


def test_a_port_already_served_is_refused_with_the_reason() -> None:
    async def go() -> None:
        first = grpc_server.create_server()
        port = bind(first, "127.0.0.1", 0, None, "worker")
        await first.start()
        try:
            second = grpc_server.create_server()
            with pytest.raises(BindError) as info:
                bind(second, "127.0.0.1", port, None, "worker")
            assert str(info.value) == (f"the worker could not listen on 127.0.0.1:{port}: Address already in use "
                                       "(another process serves it: stop it or pick another --port)")
        finally:
            await first.stop(None)
        # Once the first one has stopped, the port is free again.
        third = grpc_server.create_server()
        assert bind(third, "127.0.0.1", port, None, "worker") == port
        await third.stop(None)

    asyncio.run(go())


def test_an_address_not_of_this_host_is_refused_with_the_reason() -> None:
    async def go() -> None:
        with pytest.raises(BindError, match=r"could not listen on 192\.0\.2\.1:0: Cannot assign requested address"):
            bind(grpc_server.create_server(), "192.0.2.1", 0, None, "scheduler")  # TEST-NET-1: never local

    asyncio.run(go())


def test_the_http_front_refuses_a_served_port_with_the_reason() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError) as info:
            listen_socket("127.0.0.1", port, "OpenAI front", "--http-port")
        assert str(info.value) == (f"the OpenAI front could not listen on 127.0.0.1:{port}: Address already in use "
                                   "(another process serves it: stop it or pick another --http-port)")
        # `llmserve openai` says so and exits 1 before it serves anything (the scheduler need not exist).
        done = subprocess.run([sys.executable, "-m", "llmserve", "openai", "--scheduler", "127.0.0.1:1",
                               "--host", "127.0.0.1", "--port", str(port)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stderr
        assert (f"llmserve openai: error: the OpenAI front could not listen on 127.0.0.1:{port}: Address already in "
                "use (another process serves it: stop it or pick another --port (`llmserve up`: --http-port))"
                in done.stderr), done.stderr
    # Free again: the socket it hands the server is bound there.
    sock = listen_socket("127.0.0.1", port, "OpenAI front")
    assert sock.getsockname() == ("127.0.0.1", port)
    sock.close()
