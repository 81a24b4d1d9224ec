"""TLS for every gRPC hop: one way to bind a server port and one way to open a channel.

    client ──TLS (+ bearer token)──▶ scheduler ──mutual TLS──▶ worker
    HTTP front ──TLS (+ token)──────▶ scheduler

A ServerTLS with a client CA makes the server require and verify client certificates (mTLS):
the workers use it so that only a scheduler holding a certificate from that CA can send plans.
PEM files are read when the config is built, so a wrong path fails at start-up with the flag
that named it, not at the first handshake. Key material is never put in a message or a repr.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from shared.errors import StartupError
from shared.grpc_server import CHANNEL_OPTIONS


def read_pem(path: str, flag: str, what: str) -> bytes:
    """The bytes of a PEM file; ValueError naming the flag and the path (never the content) otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {what} file {path!r}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {path!r} is not a PEM file (expected a {what} starting with '-----BEGIN ')")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and key, and optionally the CA its clients' certificates must chain to.

    cert_file: PEM certificate chain of the server (its SANs must name the address clients dial).
    key_file: PEM private key of that certificate.
    client_ca_file: PEM CA bundle; when set, clients must present a certificate it signed (mTLS).
    flag_prefix: how the command line names these files ("tls" -> --tls-cert-file), for error messages.
    """

    cert_file: str
    key_file: str
    client_ca_file: str = ""
    flag_prefix: str = "tls"
    # Loaded in __post_init__; excluded from repr and comparison so key bytes never reach a log line.
    _pem: dict[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.cert_file or not self.key_file:
            raise ValueError(
                f"--{self.flag_prefix}-cert-file and --{self.flag_prefix}-key-file go together, got "
                f"cert_file={self.cert_file!r}, key_file={self.key_file!r}"
            )
        self._pem["cert"] = read_pem(self.cert_file, f"--{self.flag_prefix}-cert-file", "certificate")
        self._pem["key"] = read_pem(self.key_file, f"--{self.flag_prefix}-key-file", "private key")
        if self.client_ca_file:
            self._pem["ca"] = read_pem(self.client_ca_file, f"--{self.flag_prefix}-client-ca-file", "CA certificate")

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate signed by client_ca_file."""
        return bool(self.client_ca_file)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self._pem["key"], self._pem["cert"])], root_certificates=self._pem.get("ca"),
            require_client_auth=self.mutual,
        )


@dataclass(frozen=True)
class ClientTLS:
    """What a client trusts, and the certificate it presents when the server asks (mTLS).

    ca_file: PEM CA bundle that signed the server's certificate; empty = the system's roots.
    cert_file / key_file: the client's own certificate and key, both or neither.
    server_name: expected name in the server's certificate when it differs from the dialed host
      (e.g. dialing an IP); empty = the host of the address.
    flag_prefix: how the command line names these files ("worker-tls" -> --worker-tls-ca-file).
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    flag_prefix: str = "tls"
    _pem: dict[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError(
                f"--{self.flag_prefix}-cert-file and --{self.flag_prefix}-key-file go together, got "
                f"cert_file={self.cert_file!r}, key_file={self.key_file!r}"
            )
        if self.ca_file:
            self._pem["ca"] = read_pem(self.ca_file, f"--{self.flag_prefix}-ca-file", "CA certificate")
        if self.cert_file:
            self._pem["cert"] = read_pem(self.cert_file, f"--{self.flag_prefix}-cert-file", "certificate")
            self._pem["key"] = read_pem(self.key_file, f"--{self.flag_prefix}-key-file", "private key")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self._pem.get("ca"), private_key=self._pem.get("key"),
            certificate_chain=self._pem.get("cert"),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def server_tls(cert_file: str, key_file: str, client_ca_file: str = "", flag_prefix: str = "tls") -> ServerTLS | None:
    """A ServerTLS from command-line values, or None when none of them is set (plaintext).

    A client CA without a certificate is an error: the server cannot ask for client certificates
    without speaking TLS itself.
    """
    if not (cert_file or key_file or client_ca_file):
        return None
    return ServerTLS(cert_file, key_file, client_ca_file, flag_prefix)


def client_tls(ca_file: str = "", cert_file: str = "", key_file: str = "", flag_prefix: str = "tls") -> ClientTLS | None:
    """A ClientTLS from command-line values, or None when none of them is set (plaintext)."""
    if not (ca_file or cert_file or key_file):
        return None
    return ClientTLS(ca_file, cert_file, key_file, flag_prefix=flag_prefix)


class BindError(StartupError):
    """A server could not listen where it was told to (the port in use, an address not of this host)."""


def bind(server: grpc.aio.Server, host: str, port: int, tls: ServerTLS | None, role: str) -> int:
    """Adds the listening port (TLS when `tls` is set) and returns the bound port; BindError when it cannot."""
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError:  # gRPC says only "Failed to bind"; the socket layer says why
        bound = 0
    if bound == 0:
        raise BindError(f"the {role} could not listen on {address}: {_bind_failure(host, port)}")
    return bound


def listen_socket(host: str, port: int, role: str, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to host:port for a server to listen on (an HTTP front); BindError saying why it cannot.

    Bound here rather than by the server itself, so that a port in use reads as the gRPC services' does;
    ``flag`` names the option that picks another port.
    """
    try:
        return _bound_socket(host, port)
    except OSError as exc:
        raise BindError(f"the {role} could not listen on {host}:{port}: {_bind_reason(exc, flag)}") from None


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEADDR (as gRPC and uvicorn bind); OSError when it cannot be.

    IPv6 only for an address with a colon, as uvicorn decides: "localhost" binds 127.0.0.1, not ::1.
    """
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    family, kind, proto, _, where = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
    except OSError:
        sock.close()
        raise
    return sock


def _bind_reason(exc: OSError, flag: str = "--port") -> str:
    hint = f" (another process serves it: stop it or pick another {flag})" if exc.errno == errno.EADDRINUSE else ""
    return f"{exc.strerror or exc}{hint}"


def _bind_failure(host: str, port: int) -> str:
    """Why binding host:port fails, as a plain socket finds out."""
    try:
        _bound_socket(host, port).close()
    except OSError as exc:
        return _bind_reason(exc)
    return "gRPC refused it (GRPC_VERBOSITY=debug says why)"


def open_channel(address: str, tls: ClientTLS | None = None, *, aio: bool = False,
                 interceptors: list[Any] | None = None,
                 options: list[tuple[str, Any]] | None = None) -> Any:
    """A gRPC channel to `address`: TLS when `tls` is set, else plaintext; asyncio when `aio`.

    interceptors: client interceptors (e.g. shared.auth.token_interceptors) applied to every call.
    """
    opts = [*(options if options is not None else CHANNEL_OPTIONS), *(tls.channel_options() if tls else [])]
    if aio:
        if tls:
            return grpc.aio.secure_channel(address, tls.credentials(), options=opts, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
    channel = grpc.secure_channel(address, tls.credentials(), options=opts) if tls else grpc.insecure_channel(
        address, options=opts)
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


def describe(tls: ServerTLS | ClientTLS | None) -> str:
    """plaintext / TLS / mutual TLS, for start-up log lines (never a path's content)."""
    if tls is None:
        return "plaintext"
    if isinstance(tls, ServerTLS):
        return "mutual TLS (client certificates required)" if tls.mutual else "TLS"
    return "mutual TLS (client certificate presented)" if tls.cert_file else "TLS"
