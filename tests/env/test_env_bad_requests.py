"""Every kind of bad request gets a clear 4xx (or an in-band WebSocket error) and the server keeps running."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets
from wordle_helpers import answer_for

MAX_BODY = 64 * 1024  # the server's default --max-body-bytes


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        yield client
    server.assert_alive()


@pytest.fixture()
def session_id(http) -> str:
    sid = http.post("/reset", json={"seed": 77}).json()["session_id"]
    yield sid
    http.post("/close", json={"session_id": sid})


def _detail(resp: httpx.Response) -> Any:
    assert resp.headers["content-type"].startswith("application/json")
    return resp.json()["detail"]


@pytest.mark.parametrize("path", ["/reset", "/step", "/close"])
@pytest.mark.parametrize("body", [b"{not json", b'{"seed": 1,}', b"\xff\xfe", b"[1, 2"])
def test_malformed_json_is_400(http, path: str, body: bytes) -> None:
    resp = http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert "malformed JSON" in _detail(resp)


@pytest.mark.parametrize("path", ["/reset", "/step", "/close"])
def test_json_that_is_not_an_object_is_422(http, path: str) -> None:
    resp = http.post(path, json=["crane"])
    assert resp.status_code == 422 and "JSON object" in _detail(resp)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/step", {"action": {"message": "[crane]"}}, "session_id"),
        ("/step", {"session_id": "x"}, "action"),
        ("/close", {}, "session_id"),
        ("/reset", {"seed": -1}, "seed"),
        ("/reset", {"seed": "abc"}, "seed"),
    ],
)
def test_schema_violations_are_422_and_name_the_field(http, path: str, body: dict, field: str) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == 422
    assert any(field in err["loc"] for err in _detail(resp))


@pytest.mark.parametrize(
    "action",
    [{}, {"message": 5}, {"message": "[crane]", "unexpected": True}, {"msg": "[crane]"}],
)
def test_bad_action_payload_is_422(http, session_id: str, action: dict) -> None:
    resp = http.post("/step", json={"session_id": session_id, "action": action})
    assert resp.status_code == 422
    # ... and the game is untouched.
    assert http.get("/state", params={"session_id": session_id}).json()["step_count"] == 0


def test_state_without_session_is_422(http) -> None:
    assert http.get("/state").status_code == 422


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("post", "/step", {"json": {"session_id": "no-such-session", "action": {"message": "[crane]"}}}),
        ("get", "/state", {"params": {"session_id": "no-such-session"}}),
        ("post", "/close", {"json": {"session_id": "no-such-session"}}),
        ("post", "/reset", {"json": {"session_id": "no-such-session"}}),
    ],
)
def test_unknown_session_is_404(http, method: str, path: str, kwargs: dict) -> None:
    resp = getattr(http, method)(path, **kwargs)
    assert resp.status_code == 404
    assert "unknown or expired session_id" in _detail(resp)


def test_step_after_done_is_409(http) -> None:
    opened = http.post("/reset", json={"seed": 78}).json()
    sid = opened["session_id"]
    win = http.post("/step", json={"session_id": sid, "action": {"message": f"[{answer_for(78)}]"}}).json()
    assert win["done"] is True
    again = http.post("/step", json={"session_id": sid, "action": {"message": "[crane]"}})
    assert again.status_code == 409 and "reset" in _detail(again)
    assert http.post("/reset", json={"session_id": sid}).status_code == 200
    http.post("/close", json={"session_id": sid})


def test_oversize_body_is_413(http, session_id: str) -> None:
    huge = json.dumps({"session_id": session_id, "action": {"message": "[crane]" + "x" * MAX_BODY}})
    resp = http.post("/step", content=huge, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "limit" in _detail(resp)


def test_oversize_chunked_body_is_413(http) -> None:
    def chunks():
        for _ in range(80):
            yield b"x" * 1024

    resp = http.post("/reset", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413


def test_body_just_under_the_limit_is_accepted(http, session_id: str) -> None:
    """A long model completion is an invalid move with a penalty, not a transport error."""
    text = "Let me think. " * 3000  # ~42 KB, no brackets
    resp = http.post("/step", json={"session_id": session_id, "action": {"message": text}})
    assert resp.status_code == 200
    body = resp.json()
    assert body["observation"]["info"]["invalid_reason"] == "malformed"
    echoed = body["observation"]["messages"][0]["content"].split("\n[GAME] ")[-2]
    assert len(echoed) <= 300  # the echo is clipped so observations stay small


# --- WebSocket session protocol -------------------------------------------------------


async def _ws_exchange(url: str, frames: list[Any]) -> list[dict]:
    replies = []
    async with websockets.connect(url, max_size=None) as ws:
        for frame in frames:
            await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
            replies.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
    return replies


def test_websocket_bad_messages_get_error_replies_and_the_session_continues(server) -> None:
    target = answer_for(90)
    replies = asyncio.run(
        _ws_exchange(
            server.ws_url,
            [
                "{not json",
                {"type": "teleport"},
                {"type": "step", "data": {"message": "[crane]"}},  # before any reset
                {"type": "reset", "data": {"seed": 90}},
                {"type": "step", "data": {"msg": "[crane]"}},
                {"type": "step"},
                {"type": "step", "data": {"message": f"[{target}]"}},
                {"type": "step", "data": {"message": "[crane]"}},  # after done
                {"type": "state"},
            ],
        )
    )
    kinds = [(r["type"], r["data"].get("code")) for r in replies]
    assert kinds == [
        ("error", "INVALID_JSON"),
        ("error", "UNKNOWN_TYPE"),
        ("error", "EXECUTION_ERROR"),
        ("observation", None),
        ("error", "VALIDATION_ERROR"),
        ("error", "VALIDATION_ERROR"),
        ("observation", None),
        ("error", "EXECUTION_ERROR"),
        ("state", None),
    ]
    assert "send reset first" in replies[2]["data"]["message"]
    assert replies[6]["data"]["done"] is True
    assert "game is over" in replies[7]["data"]["message"]
    assert replies[8]["data"]["raw_state"]["secret_word"] == target


def test_websocket_oversize_message_closes_only_that_connection(server) -> None:
    async def run() -> int | None:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "step", "data": {"message": "x" * (MAX_BODY + 1)}}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
            return closed.value.rcvd.code if closed.value.rcvd else None

    assert asyncio.run(run()) == 1009  # "message too big"
    server.assert_alive()
    replies = asyncio.run(_ws_exchange(server.ws_url, [{"type": "reset", "data": {"seed": 1}}]))
    assert replies[0]["type"] == "observation"
