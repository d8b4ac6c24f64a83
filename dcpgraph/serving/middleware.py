"""ASGI middleware of the OpenAI server: the API key on ``/v1`` routes, and the in-flight count
vLLM's ``/load`` reports."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from .api_errors import error_body

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # what /load counts


class Authenticate:
    """ASGI middleware: ``/v1`` routes need ``Authorization: Bearer <api_key>`` when the server has
    a key (401). Plain ASGI, not ``BaseHTTPMiddleware``, so a route still sees its client's
    disconnect on the original ``receive`` channel."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        key = self.server.api_key
        if scope["type"] == "http" and key and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                response = JSONResponse(error_body(401, "invalid or missing API key", "authentication_error"),
                                        status_code=401)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class CountInFlight:
    """ASGI middleware: ``server.in_flight`` counts completion and chat requests from their
    arrival to the last byte of their response (a stream included), as vLLM's ``/load`` does."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        self.server.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.server.in_flight -= 1
