"""Session cap, isolation and idle expiry, across WebSocket and HTTP sessions."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets
from wordle_helpers import answer_for

from env_space.client import WordleEnv, WordleHTTPEnv
from env_space.models import WordleAction


def _active(srv) -> int:
    return httpx.get(f"{srv.base_url}/sessions", timeout=10).json()["active_sessions"]


def test_cap_counts_websocket_and_http_sessions_together(capped_server) -> None:
    srv = capped_server
    ws_a = WordleEnv(base_url=srv.base_url).sync()
    ws_b = WordleEnv(base_url=srv.base_url).sync()
    http = httpx.Client(base_url=srv.base_url, timeout=10)
    try:
        ws_a.reset(seed=1)
        ws_b.reset(seed=2)
        sid = http.post("/reset", json={"seed": 3}).json()["session_id"]
        assert httpx.get(f"{srv.base_url}/sessions").json() == {"active_sessions": 3, "max_sessions": 3}

        full = http.post("/reset", json={})
        assert full.status_code == 503 and "capacity" in full.json()["detail"]
        assert full.headers["retry-after"] == "1"
        # A WebSocket over the cap is told why, unprompted, and then closed.
        refused = asyncio.run(_first_ws_frame(srv.ws_url))
        assert refused["type"] == "error" and refused["data"]["code"] == "CAPACITY_REACHED"

        # Existing sessions are unaffected by the refusals.
        assert ws_a.step(WordleAction(message="[crane]")).observation.info["valid"]
        http.post("/step", json={"session_id": sid, "action": {"message": "[crane]"}}).raise_for_status()

        ws_a.close()
        _wait_for(lambda: _active(srv) == 2)
        again = http.post("/reset", json={})
        assert again.status_code == 200
        http.post("/close", json={"session_id": again.json()["session_id"]}).raise_for_status()
    finally:
        ws_a.close()
        ws_b.close()
        http.close()
    _wait_for(lambda: _active(srv) == 1)  # only the HTTP session `sid` is left
    httpx.post(f"{srv.base_url}/close", json={"session_id": sid}).raise_for_status()
    assert _active(srv) == 0


def test_interleaved_sessions_are_isolated(capped_server) -> None:
    srv = capped_server
    with WordleEnv(base_url=srv.base_url).sync() as a, WordleHTTPEnv(base_url=srv.base_url).sync() as b:
        a.reset(seed=100)
        b.reset(seed=200)
        a.step(WordleAction(message="[crane]"))
        b.step(WordleAction(message="[pious]"))
        b.step(WordleAction(message="[crane]"))  # would be a repeat only if state leaked from a
        a_state, b_state = a.state(), b.state()
        assert a_state.raw_state["guesses"] == ["crane"]
        assert b_state.raw_state["guesses"] == ["pious", "crane"]
        assert a_state.episode_id != b_state.episode_id
        win = a.step(WordleAction(message=f"[{answer_for(100)}]"))
        assert win.done and not b.state().raw_state["done"]


def test_idle_sessions_expire(expiring_server) -> None:
    srv = expiring_server
    http = httpx.Client(base_url=srv.base_url, timeout=10)
    ws = WordleEnv(base_url=srv.base_url).sync()
    try:
        sid = http.post("/reset", json={"seed": 1}).json()["session_id"]
        ws.reset(seed=1)
        assert _active(srv) == 2
        # The reaper runs every few seconds and drops sessions idle for more than 1 s.
        _wait_for(lambda: _active(srv) == 0, timeout_s=20)
        resp = http.post("/step", json={"session_id": sid, "action": {"message": "[crane]"}})
        assert resp.status_code == 404 and "expired" in resp.json()["detail"]
        with pytest.raises(RuntimeError, match="closed by the server"):
            ws.step(WordleAction(message="[crane]"))
        # A new session works as usual.
        assert http.post("/reset", json={}).status_code == 200
    finally:
        ws.close()
        http.close()
    srv.assert_alive()


async def _first_ws_frame(url: str) -> dict:
    async with websockets.connect(url) as ws:
        return json.loads(await asyncio.wait_for(ws.recv(), 10))


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)
