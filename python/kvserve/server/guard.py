"""The server's front door, an ASGI middleware that runs before any route or body parsing: the API
key (so a client without it learns nothing, not even whether its JSON parses), and the request
body's size (413 from the Content-Length header alone, or as soon as a chunked body passes the
limit). Both answer in OpenAI's error shape."""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException

# Paths any client may read without the key: a load balancer's probe and Prometheus' scrape.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class BodyTooLarge(HTTPException):
    """Raised inside the app while it reads a body past the limit: an HTTPException, so that
    the framework's body parsing passes it on as it is (the app's handler answers 413)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes (--max-body-bytes)")


def error_body(status: int, message: str, type: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code}}).encode()


async def _send_error(send, status: int, body: bytes, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def bearer_token_matches(header: str | None, api_key: str) -> bool:
    """`Authorization: Bearer KEY` (the scheme in any case, RFC 7235), compared in constant
    time."""
    if header is None:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


class RequestGuard:
    """Wraps an ASGI app: checks the API key (every path but OPEN_PATHS) and bounds the body."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and (
                not bearer_token_matches(headers.get("authorization"), self.api_key)):
            return await _send_error(send, 401, error_body(
                401, "invalid or missing API key", "invalid_request_error", "invalid_api_key"),
                [(b"www-authenticate", b"Bearer")])
        limit = self.max_body_bytes
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _send_error(send, 413, self._too_large())
        received = 0
        started = False

        async def bounded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except BodyTooLarge:  # read outside the app's handlers
            if not started:
                await _send_error(send, 413, self._too_large())

    def _too_large(self) -> bytes:
        return error_body(413, BodyTooLarge(self.max_body_bytes).detail, "invalid_request_error",
                          "request_too_large")
