"""Domain errors and their gRPC status codes, mapped in one place (shared.grpc_server.EdgeInterceptor applies it)."""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The client sent something that cannot be served as is."""


class ResourceExhaustedError(RuntimeError):
    """The server cannot take more work right now."""


class UnavailableError(RuntimeError):
    """A dependency (worker, Redis) cannot be reached."""


class AlreadyExistsError(ValueError):
    """The client reused an identifier that is still live."""


class NotFoundError(LookupError):
    """The named object does not exist (or no longer)."""


class OutOfRangeError(IndexError):
    """A position past the end of something that will not grow any more (a finished request's stream)."""


class StaleEpochError(RuntimeError):
    """A plan or reset from an engine loop that no longer owns the worker."""


class StartupError(RuntimeError):
    """A service cannot start: its port is taken, or what it needs (Redis, a first worker) stayed away. The
    command says so in one line and exits 1: a traceback would add nothing."""


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (StaleEpochError, grpc.StatusCode.FAILED_PRECONDITION),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (OutOfRangeError, grpc.StatusCode.OUT_OF_RANGE),
    # Only the client's mistakes: a ValueError raised anywhere else is a broken invariant (INTERNAL).
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code that describes an exception; INTERNAL for anything unexpected."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Ends an RPC with the status that fits `exc`; unexpected errors are logged with a traceback."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error while serving an RPC", exc_info=exc)
        await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
    await context.abort(code, str(exc))
