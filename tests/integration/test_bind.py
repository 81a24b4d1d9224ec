"""A service's gRPC port: a second server on a port already served fails to start, saying why.

gRPC sets SO_REUSEPORT by default, which let a second worker bind a served port and the kernel share the
connections between two processes (and two KV caches); the project's servers turn it off.
"""

from __future__ import annotations

import asyncio

import pytest

from shared import grpc_server
from shared.tls import BindError, bind


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
