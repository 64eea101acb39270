"""HTTP/WebSocket app wiring for the Wordle Space.

OpenEnv's own ``HTTPEnvServer`` provides ``/ws`` (the session protocol its
clients speak), ``/health``, ``/metadata`` and ``/mcp``, so OpenEnv and TRL
clients work by construction. Its HTTP ``/reset`` and ``/step`` are stateless
(each request gets a fresh environment), which cannot carry a six-turn game,
so this module swaps them for session-aware versions:

* ``POST /reset`` opens a session (or restarts the one named by ``session_id``)
  and returns OpenEnv's ``{observation, reward, done}`` plus ``session_id``;
* ``POST /step`` and ``GET /state`` take that ``session_id``;
* ``POST /close`` releases it; ``GET /sessions`` reports capacity.

HTTP and WebSocket sessions share OpenEnv's session table, so one cap
(``max_sessions``) and one idle reaper (``session_timeout_s``) cover both.
Bad requests get a 4xx with a ``detail`` message: malformed JSON 400, schema
errors 422, unknown or expired session 404, step after the game ended 409,
oversize body 413; a full server answers 503.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Query, Request, WebSocketDisconnect, status
from fastapi.responses import RedirectResponse
from fastapi.routing import APIRoute
from openenv.core.env_server.exceptions import EnvironmentFactoryError, SessionCapacityError
from openenv.core.env_server.http_server import HTTPEnvServer
from openenv.core.env_server.serialization import serialize_observation
from openenv.core.env_server.types import ConcurrencyConfig, SchemaResponse, ServerCapacityStatus
from pydantic import BaseModel, Field, ValidationError

from env_space import __version__
from env_space.environment import (
    TALLY,
    EpisodeFinishedError,
    EpisodeNotStartedError,
    SessionExpiredError,
    WordleEnvironment,
)
from env_space.models import (
    ErrorResponse,
    GameStats,
    HTTPCloseRequest,
    HTTPCloseResponse,
    HTTPResetRequest,
    HTTPStepRequest,
    HTTPStepResponse,
    WordleAction,
    WordleObservation,
    WordleState,
)
from env_space.wordle import MAX_INVALID_MOVES
from env_space.words import load_word_lists
from shared.asgi import BodySizeLimit

M = TypeVar("M", bound=BaseModel)


class ServerSettings(BaseModel):
    """Limits of one server process; the CLI exposes each as a flag."""

    max_sessions: int = Field(default=256, ge=1, description="cap on live sessions, WS + HTTP")
    session_timeout_s: float = Field(
        default=300.0, gt=0, description="idle seconds before a session is reaped"
    )
    max_body_bytes: int = Field(
        default=64 * 1024, ge=1024, description="largest HTTP body or WebSocket message"
    )
    max_invalid_moves: int = Field(
        default=MAX_INVALID_MOVES, ge=1, description="invalid moves that end one game"
    )
    enable_web: bool = Field(default=True, description="mount the Gradio page at /web")


class WordleHTTPServer(HTTPEnvServer):
    """OpenEnv's server plus HTTP sessions kept in the same session table.

    The session table and reaper are OpenEnv internals (pinned version); all
    uses of them are in this class so an upgrade has one place to check.
    """

    def __init__(self, settings: ServerSettings) -> None:
        super().__init__(
            env=functools.partial(WordleEnvironment, max_invalid_moves=settings.max_invalid_moves),
            action_cls=WordleAction,
            observation_cls=WordleObservation,
            concurrency_config=ConcurrencyConfig(
                max_concurrent_envs=settings.max_sessions,
                session_timeout=settings.session_timeout_s,
            ),
        )
        self._http_sessions: set[str] = set()

    async def open_http_session(self) -> tuple[str, WordleEnvironment]:
        try:
            session_id, env = await self._create_session()
        except SessionCapacityError as exc:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                detail=f"server is at capacity ({exc.max_sessions} sessions); retry later",
                headers={"Retry-After": "1"},
            ) from exc
        except EnvironmentFactoryError as exc:  # pragma: no cover - factory is trivial
            raise HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR, detail=str(exc)) from exc
        self._http_sessions.add(session_id)
        assert isinstance(env, WordleEnvironment)
        return session_id, env

    def http_session(self, session_id: str, *, step: bool = False) -> WordleEnvironment:
        """The live environment of an HTTP session; 404 if unknown or expired."""
        env = self._sessions.get(session_id) if session_id in self._http_sessions else None
        if not isinstance(env, WordleEnvironment):
            raise HTTPException(
                status.HTTP_404_NOT_FOUND,
                detail=f"unknown or expired session_id {session_id!r}; POST /reset to open a new session",
            )
        self._update_session_activity(session_id, increment_step=step)
        return env

    async def close_http_session(self, session_id: str) -> None:
        self.http_session(session_id)
        await self._destroy_session(session_id)

    async def _destroy_session(self, session_id: str) -> None:
        self._http_sessions.discard(session_id)
        await super()._destroy_session(session_id)


class QuietClientDisconnect:
    """ASGI middleware: swallow ``WebSocketDisconnect`` escaping a finished WebSocket handler.

    OpenEnv 0.3.0's ``/ws`` handler calls ``websocket.close()`` after the client
    has already closed; Starlette then raises, and uvicorn would log a full
    traceback for every normal session end. Nothing is left to do by then.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except WebSocketDisconnect:
            pass


async def _parse_body(request: Request, model: type[M], *, empty_ok: bool = False) -> M:
    """Parse a JSON object body into ``model``: 400 if it is not JSON, 422 if it does not fit."""
    raw = await request.body()
    if not raw.strip():
        if empty_ok:
            return model()
        raise HTTPException(status.HTTP_400_BAD_REQUEST, detail="request body must be a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, detail=f"malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, detail="request body must be a JSON object"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, detail=json.loads(exc.json(include_url=False))
        ) from exc


def _run_env(call: Callable[[], Any]) -> Any:
    """Run one environment call, mapping game-flow errors to 4xx."""
    try:
        return call()
    except EpisodeFinishedError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from exc
    except EpisodeNotStartedError as exc:  # pragma: no cover - HTTP sessions start with reset
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from exc
    except SessionExpiredError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=str(exc)) from exc


def _response(session_id: str, obs: WordleObservation) -> HTTPStepResponse:
    """Same payload as OpenEnv's WebSocket ``observation`` message, plus the session id."""
    return HTTPStepResponse(**serialize_observation(obs), session_id=session_id)


def _body_doc(model: type[BaseModel], required: bool = True) -> dict:
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 409, 413, 422, 503)
}


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """Build the app: OpenEnv routes, session-aware HTTP routes, limits, and the web page."""
    settings = settings or ServerSettings()
    load_word_lists()  # fail at startup, not on the first reset, if the packages are missing

    app = FastAPI(
        title="DeltaSync Wordle environment",
        version=__version__,
        description="OpenEnv-compatible Wordle (TextArena Wordle-v0 actions and observations).",
    )
    server = WordleHTTPServer(settings)
    server.register_routes(app)
    stateless = {"/reset", "/step", "/state", "/schema"}
    app.router.routes = [
        r for r in app.router.routes if not (isinstance(r, APIRoute) and r.path in stateless)
    ]
    app.state.wordle_server = server
    app.state.settings = settings
    _add_session_routes(app, server)

    if settings.enable_web:
        from env_space.web import mount_web

        mount_web(app, path="/web")

    @app.get("/", include_in_schema=False)
    async def root() -> Any:
        if settings.enable_web:
            return RedirectResponse("/web/")
        return {"name": "wordle", "docs": "/docs"}

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(QuietClientDisconnect)
    return app


def _add_session_routes(app: FastAPI, server: WordleHTTPServer) -> None:
    @app.post(
        "/reset",
        response_model=HTTPStepResponse,
        responses=_ERRORS,
        tags=["Environment Control"],
        summary="Start a game (opens a session unless session_id is given)",
        openapi_extra=_body_doc(HTTPResetRequest, required=False),
    )
    async def reset(request: Request) -> HTTPStepResponse:
        body = await _parse_body(request, HTTPResetRequest, empty_ok=True)
        if body.session_id is not None:
            session_id, env = body.session_id, server.http_session(body.session_id)
        else:
            session_id, env = await server.open_http_session()
        obs = _run_env(lambda: env.reset(seed=body.seed, episode_id=body.episode_id))
        return _response(session_id, obs)

    @app.post(
        "/step",
        response_model=HTTPStepResponse,
        responses=_ERRORS,
        tags=["Environment Control"],
        summary="Play one move in a session",
        openapi_extra=_body_doc(HTTPStepRequest),
    )
    async def step(request: Request) -> HTTPStepResponse:
        body = await _parse_body(request, HTTPStepRequest)
        env = server.http_session(body.session_id, step=True)
        try:
            action = WordleAction.model_validate(body.action)
        except ValidationError as exc:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT, detail=json.loads(exc.json(include_url=False))
            ) from exc
        obs = _run_env(lambda: env.step(action))
        return _response(body.session_id, obs)

    @app.get(
        "/state",
        response_model=WordleState,
        responses=_ERRORS,
        tags=["State Management"],
        summary="State of one session",
    )
    async def state(session_id: str = Query(..., min_length=1, max_length=64)) -> WordleState:
        env = server.http_session(session_id)
        return _run_env(lambda: env.state)

    @app.post(
        "/close",
        response_model=HTTPCloseResponse,
        responses=_ERRORS,
        tags=["Environment Control"],
        summary="Release a session",
        openapi_extra=_body_doc(HTTPCloseRequest),
    )
    async def close(request: Request) -> HTTPCloseResponse:
        body = await _parse_body(request, HTTPCloseRequest)
        await server.close_http_session(body.session_id)
        return HTTPCloseResponse(session_id=body.session_id)

    @app.get(
        "/sessions",
        response_model=ServerCapacityStatus,
        tags=["Health"],
        summary="Live sessions (WebSocket + HTTP) and the cap",
    )
    async def sessions() -> ServerCapacityStatus:
        return server.get_capacity_status()

    @app.get("/stats", response_model=GameStats, tags=["Health"], summary="Games played since start")
    async def stats() -> GameStats:
        return TALLY.snapshot()

    @app.get("/schema", response_model=SchemaResponse, tags=["Schema"], summary="JSON schemas")
    async def schema() -> SchemaResponse:
        return SchemaResponse(
            action=WordleAction.model_json_schema(),
            observation=WordleObservation.model_json_schema(),
            state=WordleState.model_json_schema(),
        )
