"""Pure Wordle rules: scoring, action parsing, turn limits and rewards.

No I/O and no server types here, so the rules can be tested exhaustively and
reused by the OpenEnv environment, the HTTP layer and the Gradio page alike.

Scoring follows the standard game: greens are assigned first, then each
remaining guess letter, left to right, turns yellow only while the target
still has an unmatched copy of that letter. A letter guessed more often than
the target holds it is therefore gray on the surplus copies.

Rewards (per step; see ``Rewards``):

* winning guess: ``win`` (1.0)
* any other accepted guess: ``green`` per green + ``yellow`` per yellow
  (partial credit, at most 0.08, so six partial guesses never outweigh a win)
* invalid move: ``invalid`` (-0.1); the move does not use up a guess and the
  game goes on. Only after ``max_invalid_moves`` invalid moves in one game
  does the game end, with an explicit message, so a looping client cannot
  grow a session without bound.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from env_space.words import WORD_LENGTH, WordLists

MAX_GUESSES = 6
MAX_INVALID_MOVES = 20


class Mark(StrEnum):
    """Per-letter feedback, using TextArena's letters."""

    GREEN = "G"
    YELLOW = "Y"
    GRAY = "X"


class InvalidReason(StrEnum):
    """Why a move was rejected; each costs the ``invalid`` reward."""

    MALFORMED = "malformed"
    WRONG_LENGTH = "wrong_length"
    NOT_A_WORD = "not_a_word"
    REPEATED = "repeated"


@dataclass(frozen=True)
class Rewards:
    """Reward table; the README documents the same numbers."""

    win: float = 1.0
    green: float = 0.02
    yellow: float = 0.01
    invalid: float = -0.1

    def partial(self, marks: tuple[Mark, ...]) -> float:
        """Partial credit for a non-winning guess."""
        greens = sum(m is Mark.GREEN for m in marks)
        yellows = sum(m is Mark.YELLOW for m in marks)
        return round(self.green * greens + self.yellow * yellows, 6)


DEFAULT_REWARDS = Rewards()

# The first bracketed token is the move, as in TextArena ("I'll try [crane]").
_BRACKETED = re.compile(r"\[([^\[\]]*)\]")


def score_guess(guess: str, target: str) -> tuple[Mark, ...]:
    """Feedback for ``guess`` against ``target`` (both lower-case, equal length)."""
    if len(guess) != len(target):
        raise ValueError("guess and target must have the same length")
    marks: list[Mark | None] = [None] * len(guess)
    unmatched: Counter[str] = Counter()
    for i, (g, t) in enumerate(zip(guess, target, strict=True)):
        if g == t:
            marks[i] = Mark.GREEN
        else:
            unmatched[t] += 1
    for i, g in enumerate(guess):
        if marks[i] is not None:
            continue
        if unmatched[g] > 0:
            marks[i] = Mark.YELLOW
            unmatched[g] -= 1
        else:
            marks[i] = Mark.GRAY
    return tuple(m for m in marks if m is not None)


def marks_to_str(marks: tuple[Mark, ...]) -> str:
    return "".join(m.value for m in marks)


def extract_word(message: str) -> str | None:
    """The bracketed word in an action message, lower-cased; None if there is none."""
    match = _BRACKETED.search(message)
    if match is None:
        return None
    return match.group(1).strip().lower()


def target_for_seed(seed: int | None, answers: tuple[str, ...]) -> str:
    """Pick the secret word; the same seed always picks the same word."""
    rng = random.Random(seed) if seed is not None else random.SystemRandom()
    return answers[rng.randrange(len(answers))]


class GameOverError(RuntimeError):
    """A move was sent to a game that has already finished."""


@dataclass(frozen=True)
class MoveResult:
    """Outcome of one move; ``marks`` and ``guess`` are set only for accepted guesses."""

    reward: float
    done: bool
    won: bool
    guess: str | None = None
    marks: tuple[Mark, ...] | None = None
    invalid: InvalidReason | None = None
    invalid_detail: str = ""


@dataclass
class WordleGame:
    """One game: a target, the accepted guesses so far and the invalid-move count."""

    target: str
    words: WordLists
    max_guesses: int = MAX_GUESSES
    max_invalid_moves: int = MAX_INVALID_MOVES
    rewards: Rewards = DEFAULT_REWARDS
    history: list[tuple[str, tuple[Mark, ...]]] = field(default_factory=list)
    invalid_moves: int = 0
    done: bool = False
    won: bool = False

    @property
    def guesses_left(self) -> int:
        return self.max_guesses - len(self.history)

    def play(self, message: str) -> MoveResult:
        """Apply one action message; invalid moves are results, never exceptions."""
        if self.done:
            raise GameOverError("the game is over; reset to play again")
        word = extract_word(message)
        problem = self._validate(word)
        if problem is not None:
            reason, detail = problem
            self.invalid_moves += 1
            if self.invalid_moves >= self.max_invalid_moves:
                self.done = True
                detail += f" That was invalid move {self.invalid_moves}; the game is over."
            return MoveResult(
                reward=self.rewards.invalid,
                done=self.done,
                won=False,
                invalid=reason,
                invalid_detail=detail,
            )
        assert word is not None
        marks = score_guess(word, self.target)
        self.history.append((word, marks))
        self.won = all(m is Mark.GREEN for m in marks)
        self.done = self.won or self.guesses_left == 0
        reward = self.rewards.win if self.won else self.rewards.partial(marks)
        return MoveResult(reward=reward, done=self.done, won=self.won, guess=word, marks=marks)

    def _validate(self, word: str | None) -> tuple[InvalidReason, str] | None:
        if word is None:
            return (
                InvalidReason.MALFORMED,
                "Wrap your guess in square brackets, e.g. [crane].",
            )
        if len(word) != WORD_LENGTH:
            return (
                InvalidReason.WRONG_LENGTH,
                f"Your word must be exactly {WORD_LENGTH} letters.",
            )
        if word not in self.words.guesses:
            return InvalidReason.NOT_A_WORD, f"'{word}' is not in the word list."
        if any(word == previous for previous, _ in self.history):
            return (
                InvalidReason.REPEATED,
                f"You have already guessed '{word}'. Try a different word.",
            )
        return None
