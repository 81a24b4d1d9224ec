"""One way to open a Redis client, for every service that talks to the state store.

Blocking reads (XREAD / BLPOP) wait up to a few seconds, so the socket timeout must exceed them;
a connection that cannot be made within a few seconds is reported rather than waited on.

Security: AUTH with a password from RedisOptions (read from a file or LLMSERVE_REDIS_PASSWORD by the
command line, never from argv), TLS with a `rediss://` URL verified against the system roots or
`ca_file`. The password is kept out of every repr, log line and error message.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection

try:
    from hiredis import pack_command as _pack_in_c
except ImportError:  # redis-py's own (Python) packing then
    _pack_in_c = None

from shared.secrets import redact_url, url_has_password
from shared.tls import read_pem

# Longest any single Redis command may take, blocking reads included.
SOCKET_TIMEOUT_SECONDS = 30.0
CONNECT_TIMEOUT_SECONDS = 5.0
_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class RedisOptions:
    """How to authenticate to Redis and verify its TLS certificate.

    password: AUTH password (Redis `requirepass` or an ACL user's; the user goes in the URL).
    ca_file: PEM CA bundle that signed the server's certificate; needs a rediss:// URL.
    """

    password: str = field(default="", repr=False)
    ca_file: str = ""

    def __post_init__(self) -> None:
        if self.ca_file:
            read_pem(self.ca_file, "--redis-ca-file", "CA certificate")

    def check_url(self, url: str) -> None:
        """ValueError (with the URL redacted) for a URL these options cannot be used with."""
        scheme = urlsplit(url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {redact_url(url)!r}")
        if self.ca_file and scheme != "rediss":
            raise ValueError(f"--redis-ca-file needs a rediss:// (TLS) redis_url, got {redact_url(url)!r}")
        if self.password and url_has_password(url):
            raise ValueError(f"the redis_url {redact_url(url)!r} carries a password and --redis-password-file / "
                             "LLMSERVE_REDIS_PASSWORD sets another; keep one (the file keeps it out of argv)")

    def client_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.password:
            kwargs["password"] = self.password
        if self.ca_file:
            kwargs["ssl_ca_certs"] = self.ca_file
        return kwargs


class _PackedInC(AbstractConnection):
    """Packs commands with hiredis's C serializer, as redis-py's blocking client does when hiredis is installed;
    its asyncio connection packs in Python, which cost a scheduler replica ~8 % of its CPU under load (each
    step commits a script call with a few hundred arguments and reads every client's stream in one XREAD)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        command = args[0]
        if isinstance(command, str):  # 'CONFIG GET', as redis-py splits it
            args = (*command.encode().split(), *args[1:])
        elif b" " in command:
            args = (*command.split(), *args[1:])
        try:
            return [_pack_in_c(args)]
        except TypeError:  # memoryviews, or a value Redis cannot take: redis-py's packing (and its DataError)
            return super().pack_command(*args)

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        return [b"".join(chunk for command in commands for chunk in self.pack_command(*command))]


def connect(url: str, max_connections: int = 1024, options: RedisOptions | None = None) -> aioredis.Redis:
    """An asyncio Redis client for `url` (redis://host:port/db, rediss:// for TLS); connects lazily."""
    opts = options or RedisOptions()
    opts.check_url(url)
    client = aioredis.Redis.from_url(
        url, max_connections=max_connections, health_check_interval=30,
        socket_timeout=SOCKET_TIMEOUT_SECONDS, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        **opts.client_kwargs(),
    )
    if _pack_in_c is not None:
        pool = client.connection_pool
        base = pool.connection_class  # plain, TLS or unix socket, as the URL says
        pool.connection_class = type(f"PackedInC{base.__name__}", (_PackedInC, base), {})
    return client
