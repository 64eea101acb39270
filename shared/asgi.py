"""Plain ASGI middleware the Spaces share (no web framework imported: any ASGI app can use it)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

BAD_REQUEST, CONTENT_TOO_LARGE = 400, 413


class BodySizeLimit:
    """Refuse HTTP request bodies over ``max_bytes`` with 413 and ``{"detail": ...}`` before the
    app reads them.

    A declared ``Content-Length`` is checked up front (the server then holds the client to it); a
    chunked body is read up to the limit, refused as soon as it passes it, else replayed to the
    app in one piece. WebSocket messages are not HTTP bodies: cap them with the server's own
    setting (uvicorn's ``ws_max_size``).
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await reject(send, BAD_REQUEST, "invalid Content-Length header")
                return
            if int(declared) > self.max_bytes:
                await self._too_large(send)
                return
            await self.app(scope, receive, send)
            return
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away while sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # e.g. http.disconnect, for handlers that watch for it

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await reject(send, CONTENT_TOO_LARGE, f"request body exceeds the {self.max_bytes}-byte limit")


async def reject(send: Send, status: int, detail: str) -> None:
    """Answer ``status`` with ``{"detail": detail}`` and close the connection (the rest of the
    body, if any, is never read)."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
