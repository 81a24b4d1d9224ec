"""Command-line flags for TLS, mutual TLS, the bearer token and Redis AUTH, and the configs they build.

    llmserve scheduler --tls-cert-file --tls-key-file [--tls-client-ca-file]   public API over TLS
                       --auth-token-file (or LLMSERVE_AUTH_TOKEN)                bearer token on the public API
                       --worker-tls-ca-file --worker-tls-cert-file --worker-tls-key-file   mTLS to workers
                       --redis-password-file (or LLMSERVE_REDIS_PASSWORD) --redis-ca-file (rediss://)
    llmserve worker    --tls-cert-file --tls-key-file --tls-client-ca-file     mTLS: only trusted schedulers
    llmserve generate / openai / bench   --tls-ca-file --auth-token-file          clients of the public API
    llmserve openai    --api-key-file (or LLMSERVE_API_KEY)                      HTTP clients' bearer key
                       --http-tls-cert-file --http-tls-key-file [--http-tls-client-ca-file]   HTTPS

Secrets themselves never go on the command line (it shows in `ps`): a file, or one environment
variable read when the command runs.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from shared.secrets import resolve_secret

if TYPE_CHECKING:  # grpc and redis load only when a command builds its config: `llmserve --help` stays fast
    from shared.redis_client import RedisOptions
    from shared.tls import ClientTLS, ServerTLS

AUTH_TOKEN_ENV = "LLMSERVE_AUTH_TOKEN"
REDIS_PASSWORD_ENV = "LLMSERVE_REDIS_PASSWORD"
API_KEY_ENV = "LLMSERVE_API_KEY"


def add_server_tls_flags(p: argparse.ArgumentParser, what: str, mutual_help: str) -> None:
    """--tls-cert-file / --tls-key-file / --tls-client-ca-file of a gRPC server."""
    g = p.add_argument_group("TLS")
    g.add_argument("--tls-cert-file", default="", metavar="PEM",
                   help=f"serve {what} over TLS with this certificate (chain); needs --tls-key-file")
    g.add_argument("--tls-key-file", default="", metavar="PEM", help="private key of --tls-cert-file")
    g.add_argument("--tls-client-ca-file", default="", metavar="PEM", help=mutual_help)


def add_auth_token_flag(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--auth-token-file", default="", metavar="PATH",
                   help=f"file holding the bearer token {role} (or the token itself in {AUTH_TOKEN_ENV})")


def add_worker_client_tls_flags(p: argparse.ArgumentParser) -> None:
    """How the scheduler reaches its workers: TLS, presenting a client certificate for mTLS."""
    g = p.add_argument_group("TLS to the workers")
    g.add_argument("--worker-tls-ca-file", default="", metavar="PEM",
                   help="reach the workers over TLS, trusting this CA (their --tls-cert-file's issuer)")
    g.add_argument("--worker-tls-cert-file", default="", metavar="PEM",
                   help="client certificate presented to the workers (signed by their --tls-client-ca-file)")
    g.add_argument("--worker-tls-key-file", default="", metavar="PEM", help="private key of --worker-tls-cert-file")


def add_redis_security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Redis security")
    g.add_argument("--redis-password-file", default="", metavar="PATH",
                   help=f"file holding the Redis AUTH password (or the password itself in {REDIS_PASSWORD_ENV}); "
                        "an ACL user goes in the URL: redis://USER@host:6379/0")
    g.add_argument("--redis-ca-file", default="", metavar="PEM",
                   help="CA that signed Redis's certificate, for a rediss:// (TLS) --redis-url "
                        "(default: the system's roots)")


def add_client_security_flags(p: argparse.ArgumentParser) -> None:
    """--tls-ca-file and --auth-token-file of a client of the public API."""
    p.add_argument("--tls-ca-file", default="", metavar="PEM",
                   help="reach the scheduler over TLS, trusting this CA (its --tls-cert-file's issuer)")
    add_auth_token_flag(p, "sent to the scheduler")


def server_tls_from(args: argparse.Namespace) -> ServerTLS | None:
    from shared.tls import server_tls  # noqa: PLC0415

    return server_tls(args.tls_cert_file, args.tls_key_file, getattr(args, "tls_client_ca_file", ""))


def worker_tls_from(args: argparse.Namespace) -> ClientTLS | None:
    from shared.tls import client_tls  # noqa: PLC0415

    return client_tls(args.worker_tls_ca_file, args.worker_tls_cert_file, args.worker_tls_key_file, "worker-tls")


def client_tls_from(args: argparse.Namespace) -> ClientTLS | None:
    from shared.tls import client_tls  # noqa: PLC0415

    return client_tls(args.tls_ca_file)


def auth_token_from(args: argparse.Namespace) -> str:
    """The bearer token from --auth-token-file or LLMSERVE_AUTH_TOKEN ("" = no token)."""
    return resolve_secret(args.auth_token_file, "--auth-token-file", AUTH_TOKEN_ENV)


def api_key_from(args: argparse.Namespace) -> str:
    """The HTTP front's API key from --api-key-file or LLMSERVE_API_KEY ("" = open)."""
    return resolve_secret(args.api_key_file, "--api-key-file", API_KEY_ENV)


def redis_options_from(args: argparse.Namespace) -> RedisOptions:
    from shared.redis_client import RedisOptions  # noqa: PLC0415

    password = resolve_secret(args.redis_password_file, "--redis-password-file", REDIS_PASSWORD_ENV)
    return RedisOptions(password=password, ca_file=args.redis_ca_file)
