"""A loopback relay that lets trl reach a rollout Space that wants credentials.

trl's rollout worker posts ``/v1/completions`` from its own ``aiohttp`` session and its
``VLLMClient`` uses plain ``requests``: neither takes headers, so trl cannot present the
rollout Space's API key (``--api-key``, which guards ``/v1/*`` as in ``vllm serve``) or, for a
private Space, a Hugging Face token. Rather than patch trl, the trainer points trl's
``vllm_server_base_url`` at this relay on ``127.0.0.1``, which forwards each request to the real
replica with the ``Authorization`` header added. It listens on loopback only, so the credential
never leaves the trainer's process boundary except towards the replica.
"""

from __future__ import annotations

import contextlib
import threading

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shared.process import free_port, wait_healthy

# Per-hop headers (RFC 9110 section 7.6.1) and those httpx sets itself.
HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate", "content-length", "authorization"}


class AuthRelay:
    """``with AuthRelay(upstream, token) as relay:`` then give trl ``relay.url``."""

    def __init__(self, upstream: str, token: str, *, timeout_s: float = 600.0):
        self.upstream, self.port = upstream.rstrip("/"), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._auth = {"authorization": f"Bearer {token}"}
        self._timeout_s = timeout_s
        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=methods)], lifespan=self._lifespan)
        self._client: httpx.AsyncClient | None = None
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="deltasync-relay", daemon=True)

    async def _forward(self, request: Request) -> Response:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.upstream, timeout=self._timeout_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS} | self._auth
        try:
            r = await self._client.request(request.method, request.url.path, params=request.query_params,
                                           content=await request.body(), headers=headers)
        except httpx.HTTPError as e:
            return Response(f"relay could not reach {self.upstream}: {type(e).__name__}", status_code=502)
        out = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        return Response(r.content, status_code=r.status_code, headers=out)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        if self._client is not None:
            await self._client.aclose()

    def __enter__(self) -> AuthRelay:
        self._thread.start()
        wait_healthy(self.url, 60)  # the replica's /health, through the relay
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
