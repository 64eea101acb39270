"""The OpenEnv ``Environment`` that presents a Wordle game the way TextArena does.

The game rules live in ``env_space.wordle``; this module only turns moves into
observations laid out as OpenEnv's TextArena Wordle server lays them out, since
TRL's Wordle example depends on it: ``messages`` is always ONE message whose
``content`` is the whole conversation so far, each entry rendered as
``"\n[GAME] " + text`` (TextArena's LLM observation wrapper). Text is only ever
appended, so the example's ``content[len(previous):]`` is exactly the game's
answer to the last move: the echoed move, then ``Feedback:`` with a row of
G/Y/X for an accepted guess, or "You attempted an invalid move. ..." for a
rejected one, and the end-of-game line. The entries themselves, with
TextArena's categories (``PROMPT``, ``PLAYER_ACTION``, ``GAME_MESSAGE``,
``GAME_ADMIN``), stay on the server (:attr:`WordleEnvironment.entries`).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from env_space import __version__
from env_space.models import (
    ENV_ID,
    GAME_SENDER_ID,
    GameStats,
    PLAYER_ID,
    WordleAction,
    WordleMessage,
    WordleObservation,
    WordleState,
)
from env_space.wordle import (
    MAX_GUESSES,
    MAX_INVALID_MOVES,
    GameOverError,
    MoveResult,
    WordleGame,
    marks_to_str,
    target_for_seed,
)
from env_space.words import WORD_LENGTH, load_word_lists

# What TextArena's server calls the one merged message of a rendered conversation.
TRANSCRIPT_CATEGORY = "MESSAGE"
# Echoed player text is capped so a model that rambles cannot bloat every later observation.
MAX_ECHO_CHARS = 300


class _Tally:
    """Counts over every session of the process, for ``GET /stats`` (a trainer's monitor reads it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = GameStats()

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, n in counts.items():
                setattr(self._stats, key, getattr(self._stats, key) + n)

    def snapshot(self) -> GameStats:
        with self._lock:
            return self._stats.model_copy()


TALLY = _Tally()


class EpisodeNotStartedError(RuntimeError):
    """``step`` before any ``reset``."""


class EpisodeFinishedError(RuntimeError):
    """``step`` after the game has ended; the client must ``reset``."""


class SessionExpiredError(RuntimeError):
    """The server closed this environment (idle expiry or shutdown)."""


def game_prompt(max_guesses: int = MAX_GUESSES) -> str:
    return (
        "You are Playing Wordle.\n"
        f"A secret {WORD_LENGTH}-letter word has been chosen. "
        f"You have {max_guesses} attempts to guess it.\n"
        "For each guess, wrap your word in square brackets (e.g., '[apple]').\n"
        "Feedback for each letter will be given as follows:\n"
        "  - G (green): correct letter in the correct position\n"
        "  - Y (yellow): letter exists in the word but in the wrong position\n"
        "  - X (wrong): letter is not in the word\n"
        "A letter guessed more often than the word contains it is marked X on the extra copies.\n"
        "Invalid moves (no brackets, wrong length, unknown or repeated word) cost a small "
        "penalty but no attempt.\n"
        "Enter your guess to begin.\n"
    )


class WordleEnvironment(Environment[WordleAction, WordleObservation, WordleState]):
    """One isolated Wordle session; the server makes one per WebSocket or HTTP session."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    # Moves take microseconds: one shared worker thread serves every session
    # instead of a thread per session.
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(self, max_invalid_moves: int = MAX_INVALID_MOVES) -> None:
        super().__init__()
        self._words = load_word_lists()
        self._max_invalid_moves = max_invalid_moves
        self._game: WordleGame | None = None
        self._entries: list[WordleMessage] = []
        self._state = WordleState(max_turns=MAX_GUESSES)
        self._closed = False

    # -- OpenEnv API -------------------------------------------------------------

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        **kwargs: Any,
    ) -> WordleObservation:
        self._check_open()
        target = target_for_seed(seed, self._words.answers)
        self._game = WordleGame(target=target, words=self._words, max_invalid_moves=self._max_invalid_moves)
        prompt = game_prompt()
        self._entries = [WordleMessage(sender_id=GAME_SENDER_ID, content=prompt, category="PROMPT")]
        self._state = WordleState(
            episode_id=episode_id or str(uuid.uuid4()),
            step_count=0,
            max_turns=MAX_GUESSES,
        )
        self._state.raw_state = self._raw_state()
        TALLY.add(games_started=1)
        return self._observation(reward=0.0, done=False, info={})

    def step(
        self,
        action: WordleAction,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> WordleObservation:
        self._check_open()
        if self._game is None:
            raise EpisodeNotStartedError("no game in progress; send reset first")
        if self._game.done:
            raise EpisodeFinishedError("the game is over; send reset to start a new one")
        try:
            result = self._game.play(action.message)
        except GameOverError as exc:  # pragma: no cover - guarded above
            raise EpisodeFinishedError(str(exc)) from exc

        self._entries.append(
            WordleMessage(sender_id=PLAYER_ID, content=_clip(action.message), category="PLAYER_ACTION")
        )
        self._entries.extend(self._game_messages(result))
        info = self._info(result)
        TALLY.add(guesses=int(result.invalid is None), invalid_moves=int(result.invalid is not None),
                  games_won=int(result.won), games_lost=int(result.done and not result.won))

        self._state.step_count += 1
        self._state.turn = len(self._game.history)
        self._state.last_reward = result.reward
        self._state.last_info = info
        self._state.raw_state = self._raw_state()
        return self._observation(reward=result.reward, done=result.done, info=info)

    @property
    def state(self) -> WordleState:
        self._check_open()
        return self._state

    def close(self) -> None:
        self._closed = True

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="Wordle",
            description=(
                "Wordle (TextArena Wordle-v0 compatible): guess a 5-letter word in 6 tries; "
                "actions are messages like '[crane]'."
            ),
            version=__version__,
        )

    # -- helpers -----------------------------------------------------------------

    @property
    def entries(self) -> list[WordleMessage]:
        """The conversation entry by entry, with TextArena's categories."""
        return list(self._entries)

    @property
    def transcript(self) -> str:
        """The conversation as TextArena renders it for an LLM: ``"\n[GAME] " + text`` per entry."""
        return "".join(f"\n[GAME] {e.content}" for e in self._entries)

    @property
    def game(self) -> WordleGame | None:
        """The running game, for the in-process web page."""
        return self._game

    def _check_open(self) -> None:
        if self._closed:
            raise SessionExpiredError(
                "this session was closed by the server (idle expiry); reconnect and reset"
            )

    def _observation(self, *, reward: float, done: bool, info: dict[str, Any]) -> WordleObservation:
        return WordleObservation(
            prompt=self._entries[0].content,
            messages=[WordleMessage(sender_id=GAME_SENDER_ID, content=self.transcript,
                                    category=TRANSCRIPT_CATEGORY)],
            info=info,
            reward=reward,
            done=done,
            metadata={"env_id": ENV_ID, "turn": self._state.turn},
        )

    def _game_messages(self, result: MoveResult) -> list[WordleMessage]:
        game = self._game
        assert game is not None
        out: list[WordleMessage] = []
        if result.invalid is not None:
            out.append(
                _game_msg(
                    "You attempted an invalid move. Reason: "
                    f"{result.invalid_detail} Please resubmit a valid move.",
                    "GAME_ADMIN",
                )
            )
        else:
            assert result.guess is not None and result.marks is not None
            left = game.guesses_left
            out.append(
                _game_msg(
                    f"You submitted [{result.guess}].\nFeedback:\n"
                    f"{' '.join(result.guess.upper())}\n"
                    f"{' '.join(m.value for m in result.marks)}\n"
                    f"You have {left} {'guess' if left == 1 else 'guesses'} left.",
                    "GAME_MESSAGE",
                )
            )
        if result.done:
            if result.won:
                text = (
                    "Congratulations! You guessed the word correctly in "
                    f"{len(game.history)} {'guess' if len(game.history) == 1 else 'guesses'}!"
                )
            else:
                text = f"Game over. The secret word was: **{game.target}**."
            out.append(_game_msg(text, "GAME_ADMIN"))
        return out

    def _info(self, result: MoveResult) -> dict[str, Any]:
        """Per-step details; ``reward_signals`` uses the names OpenEnv's TextArena Wordle emits."""
        game = self._game
        assert game is not None
        greens = yellows = 0
        if result.marks is not None:
            greens = sum(m.value == "G" for m in result.marks)
            yellows = sum(m.value == "Y" for m in result.marks)
        info: dict[str, Any] = {
            "valid": result.invalid is None,
            "guess": result.guess,
            "feedback": marks_to_str(result.marks) if result.marks else None,
            "guesses_left": game.guesses_left,
            "invalid_moves": game.invalid_moves,
            "won": result.won,
            "reward_signals": {
                "wordle.greens": greens / WORD_LENGTH,
                "wordle.yellows": yellows / WORD_LENGTH,
                "wordle.repetitions": 0.0 if result.invalid and result.invalid.value == "repeated" else 1.0,
                "wordle.correct": 1.0 if result.won else 0.0,
            },
        }
        if result.invalid is not None:
            info["invalid_reason"] = result.invalid.value
            info["invalid_detail"] = result.invalid_detail
        return info

    def _raw_state(self) -> dict[str, Any]:
        game = self._game
        if game is None:
            return {}
        raw: dict[str, Any] = {
            "guesses": [w for w, _ in game.history],
            "feedback": [marks_to_str(m) for _, m in game.history],
            "guesses_left": game.guesses_left,
            "invalid_moves": game.invalid_moves,
            "done": game.done,
            "won": game.won,
        }
        if game.done:
            raw["secret_word"] = game.target
        return raw


def _game_msg(content: str, category: str) -> WordleMessage:
    return WordleMessage(sender_id=GAME_SENDER_ID, content=content, category=category)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 1] + "…"
