"""Secrets (the API token, the Redis password) from a file or the environment, never from argv.

A value on the command line shows in `ps` and in shell history, so secrets come from a file
(`--auth-token-file`, a mounted Kubernetes Secret) or one environment variable. Errors name the
file and the flag, never the secret; URLs are redacted before they reach a log line or a message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"


def read_secret_file(path: str, flag: str) -> str:
    """The secret in `path` without surrounding whitespace (a trailing newline is usual); ValueError if empty."""
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag}: {path!r} is not UTF-8 text") from exc
    if not value:
        raise ValueError(f"{flag}: {path!r} is empty")
    return value


def resolve_secret(file_path: str, flag: str, env_var: str, environ: Mapping[str, str] | None = None) -> str:
    """The secret from `file_path` (flag `flag`) or the variable `env_var`; "" when neither is set.

    Both set is an error rather than a silent choice: one of them is stale, and which one wins
    would decide what the service accepts.
    """
    env = os.environ if environ is None else environ
    from_env = env.get(env_var, "").strip()
    if file_path and from_env:
        raise ValueError(f"{flag} and the environment variable {env_var} are both set; set only one")
    if file_path:
        return read_secret_file(file_path, flag)
    return from_env


def redact_url(url: str) -> str:
    """`url` with any password replaced by ***: redis://:hunter2@host:6379/0 -> redis://:***@host:6379/0."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return REDACTED  # unparsable: it might be anything, including a secret
    if not password:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))


def url_has_password(url: str) -> bool:
    """Whether a URL carries a password (redis://user:pw@host)."""
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return False
