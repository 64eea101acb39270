"""Pydantic models for everything that crosses the wire.

The action, observation and state models have the same field names and types
as OpenEnv's TextArena environment (``TextArenaAction`` / ``TextArenaObservation``
/ ``TextArenaState``), so TextArena clients -- including TRL's Wordle example --
parse our payloads unchanged. The HTTP request/response models add the one
thing stock OpenEnv HTTP lacks for a multi-turn game: a session id.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, ResetRequest, State
from pydantic import BaseModel, ConfigDict, Field

ENV_ID = "Wordle-v0"
GAME_SENDER_ID = -1  # TextArena's GAME_ID: messages from the game itself
PLAYER_ID = 0


class WordleMessage(BaseModel):
    """One entry of the conversation; ``category`` uses TextArena's names."""

    sender_id: int
    content: str
    category: str


class WordleAction(Action):
    """A move: free text whose first ``[word]`` is the guess, e.g. ``"[crane]"``."""

    message: str


class WordleObservation(Observation):
    """What the player sees: the game prompt and the whole conversation so far."""

    prompt: str
    messages: list[WordleMessage] = Field(default_factory=list)
    current_player_id: int = PLAYER_ID
    legal_players: list[int] = Field(default_factory=lambda: [PLAYER_ID])
    info: dict[str, Any] = Field(default_factory=dict)


class WordleState(State):
    """Server-side snapshot; the target appears in ``raw_state`` only once the game is over."""

    env_id: str = ENV_ID
    num_players: int = 1
    max_turns: int | None = None
    turn: int = 0
    last_reward: float = 0.0
    last_info: dict[str, Any] = Field(default_factory=dict)
    raw_state: dict[str, Any] = Field(default_factory=dict)


class HTTPResetRequest(ResetRequest):
    """``POST /reset``: omit ``session_id`` to open a session, give it to restart one."""

    session_id: str | None = Field(default=None, max_length=64)


class HTTPStepRequest(BaseModel):
    """``POST /step``: an action for the session that ``/reset`` returned."""

    model_config = ConfigDict(extra="ignore")

    session_id: str = Field(..., min_length=1, max_length=64)
    action: dict[str, Any]
    timeout_s: float | None = Field(default=None, gt=0)
    request_id: str | None = Field(default=None, max_length=255)


class HTTPCloseRequest(BaseModel):
    """``POST /close``: release a session before it would expire."""

    model_config = ConfigDict(extra="ignore")

    session_id: str = Field(..., min_length=1, max_length=64)


class HTTPStepResponse(BaseModel):
    """Response of ``/reset`` and ``/step``: OpenEnv's shape plus the session id."""

    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False
    session_id: str


class HTTPCloseResponse(BaseModel):
    session_id: str
    closed: bool = True


class GameStats(BaseModel):
    """``GET /stats``: what every session of this server has played since it started."""

    games_started: int = 0
    games_won: int = 0
    games_lost: int = 0
    guesses: int = 0  # accepted guesses
    invalid_moves: int = 0


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx the Wordle routes return."""

    detail: Any
