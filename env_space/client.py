"""Python clients for the Wordle Space, built on OpenEnv's ``EnvClient``.

``WordleEnv`` is a plain OpenEnv client over the ``/ws`` session protocol,
shaped like OpenEnv's ``TextArenaEnv`` (any TextArena client works as well).
``WordleHTTPEnv`` keeps the very same API -- ``reset``/``step``/``state``,
``async with``, ``.sync()`` -- but carries each message over the session-aware
HTTP routes instead, for callers that cannot hold a WebSocket open.
"""

from __future__ import annotations

from typing import Any

import httpx
from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from env_space.models import WordleAction, WordleObservation, WordleState


class WordleEnv(EnvClient[WordleAction, WordleObservation, WordleState]):
    """OpenEnv WebSocket client: ``WordleEnv(base_url="http://host:port")``."""

    def _step_payload(self, action: WordleAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[WordleObservation]:
        obs = WordleObservation.model_validate(
            {
                **payload.get("observation", {}),
                "reward": payload.get("reward"),
                "done": payload.get("done", False),
            }
        )
        return StepResult(observation=obs, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> WordleState:
        return WordleState.model_validate(payload)


class WordleHTTPEnv(WordleEnv):
    """Same client over HTTP: ``/reset`` opens a server-side session, later calls name it."""

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        super().__init__(base_url=base_url, message_timeout_s=timeout_s)
        self._base_url = base_url.rstrip("/").replace("ws://", "http://").replace("wss://", "https://")
        self._timeout_s = timeout_s
        self._http: httpx.AsyncClient | None = None
        self.session_id: str | None = None

    async def connect(self) -> WordleHTTPEnv:
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self._base_url, timeout=self._timeout_s)
        return self

    async def disconnect(self) -> None:
        if self._http is None:
            return
        try:
            if self.session_id is not None:
                await self._http.post("/close", json={"session_id": self.session_id})
        except httpx.HTTPError:
            pass  # best effort: the server reaps idle sessions anyway
        finally:
            self.session_id = None
            await self._http.aclose()
            self._http = None

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        """Map an OpenEnv session message onto one HTTP call; errors raise like the WS client."""
        await self.connect()
        assert self._http is not None
        kind = message.get("type")
        data = message.get("data", {})
        if kind == "reset":
            body = dict(data)
            if self.session_id is not None:
                body["session_id"] = self.session_id
            resp = await self._http.post("/reset", json=body)
        elif kind == "step":
            resp = await self._http.post(
                "/step", json={"session_id": self._require_session(), "action": data}
            )
        elif kind == "state":
            resp = await self._http.get("/state", params={"session_id": self._require_session()})
        else:
            raise ValueError(f"unsupported message type over HTTP: {kind!r}")
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise RuntimeError(f"Server error: {detail} (HTTP {resp.status_code})")
        payload = resp.json()
        if kind == "reset":
            self.session_id = payload["session_id"]
        return {"type": "state" if kind == "state" else "observation", "data": payload}

    def _require_session(self) -> str:
        if self.session_id is None:
            raise RuntimeError("no session yet: call reset() first")
        return self.session_id
