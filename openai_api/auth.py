"""The HTTP front's API key (vLLM's --api-key): `Authorization: Bearer <key>` on every /v1 route.

/health stays open for load balancers and Kubernetes probes. The key is compared in constant time;
a refusal is a 401 in OpenAI's error format (code `invalid_api_key`), and the presented value is
never echoed or logged. Separate from the token the front sends to the scheduler (--auth-token-file):
the two may be the same secret, but the front's clients need not hold the scheduler's.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from openai_api.errors import OpenAIError
from shared.auth import parse_bearer

PROTECTED_PREFIX = "/v1"


def require_api_key(app: FastAPI, api_key: str) -> None:
    """Makes every route under /v1 answer 401 unless the request carries `Authorization: Bearer <api_key>`."""
    if not api_key:
        raise ValueError("api_key must be a non-empty string, got ''")
    expected = api_key.encode()

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if not request.url.path.startswith(PROTECTED_PREFIX):
            return await call_next(request)
        key = parse_bearer(request.headers.get("authorization", ""))
        if key is not None and hmac.compare_digest(key.encode(), expected):
            return await call_next(request)
        message = ("You didn't provide an API key: send the header 'Authorization: Bearer <key>'." if key is None
                   else "Incorrect API key provided.")
        error = OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")
        return JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
