"""OpenAI's error format, and the mapping from gRPC status codes to HTTP ones, in one place.

Every error the front returns has OpenAI's body:
    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": "invalid_argument"}}
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

# gRPC status -> (HTTP status, OpenAI error type). Anything missing is a 500 server_error.
_HTTP_FOR_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
}


@dataclass
class OpenAIError(Exception):
    """An error the front answers with: HTTP status plus OpenAI's error fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, dict[str, object]]:
        """The JSON body OpenAI clients parse (`openai.APIStatusError.body` is the inner object)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None) -> OpenAIError:
    """A 400 for a request field the front itself rejects (before any gRPC call)."""
    return OpenAIError(400, message, "invalid_request_error", param, "invalid_argument")


def model_not_found(model: str) -> OpenAIError:
    """A 404 for a `model` that this front does not serve (OpenAI's own code for it)."""
    return OpenAIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def from_grpc(code: grpc.StatusCode, details: str) -> OpenAIError:
    """The HTTP error for a failed gRPC call (INVALID_ARGUMENT -> 400, RESOURCE_EXHAUSTED -> 429, ...)."""
    status, kind = _HTTP_FOR_GRPC.get(code, (500, "server_error"))
    return OpenAIError(status, details or code.name, kind, None, code.name.lower())


def from_rpc_error(exc: grpc.aio.AioRpcError) -> OpenAIError:
    """from_grpc for an exception raised by a grpc.aio call."""
    return from_grpc(exc.code(), exc.details() or "")


def failed_after_admission(message: str) -> OpenAIError:
    """The request was admitted but could not be served (GenerateResponse.error): a server-side error."""
    return OpenAIError(500, message, "server_error", None, "generation_failed")
