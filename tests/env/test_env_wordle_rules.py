"""The pure rules: feedback tables (repeated letters), parsing, turns, rewards, seeds, word lists."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from env_space.environment import WordleEnvironment
from env_space.models import WordleAction
from env_space.wordle import (
    DEFAULT_REWARDS,
    GameOverError,
    InvalidReason,
    Mark,
    WordleGame,
    extract_word,
    marks_to_str,
    score_guess,
    target_for_seed,
)
from env_space.words import load_word_lists

# (target, guess, feedback) -- worked by hand; the tricky ones involve repeated letters.
FEEDBACK_TABLE = [
    ("crane", "crane", "GGGGG"),
    ("crane", "study", "XXXXX"),
    ("chair", "crane", "GYGXX"),
    # Surplus copies are gray; greens claim their letter before any yellow does.
    ("abcde", "eeeee", "XXXXG"),
    ("those", "geese", "XXXGG"),
    ("hello", "lolly", "XYGGX"),
    ("lemon", "melee", "YGYXX"),
    # Yellows are handed out left to right while unmatched copies remain.
    ("speed", "eerie", "YYXXX"),
    ("array", "rarer", "YYGXX"),
    ("abbey", "kebab", "XYGYY"),
    ("aabbb", "bbbaa", "YYGYY"),
    # Two copies guessed, one in the target, neither in place: only the first is yellow.
    ("hairy", "error", "XYXXX"),
    ("robot", "floor", "XXYGY"),
    ("mummy", "mamma", "GXGGX"),
]


@pytest.mark.parametrize(("target", "guess", "expected"), FEEDBACK_TABLE)
def test_feedback_table(target: str, guess: str, expected: str) -> None:
    assert marks_to_str(score_guess(guess, target)) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abcde", min_size=5, max_size=5),
    st.text(alphabet="abcde", min_size=5, max_size=5),
)
def test_feedback_invariants(target: str, guess: str) -> None:
    """Greens are exact matches; per letter, greens + yellows = min(copies in guess, in target)."""
    marks = score_guess(guess, target)
    for i, m in enumerate(marks):
        assert (m is Mark.GREEN) == (guess[i] == target[i])
    credited = Counter(g for g, m in zip(guess, marks, strict=True) if m is not Mark.GRAY)
    for letter in set(guess):
        assert credited[letter] == min(guess.count(letter), target.count(letter))
    # A yellow never appears to the right of a gray copy of the same letter.
    for i, m in enumerate(marks):
        if m is Mark.YELLOW:
            assert not any(guess[j] == guess[i] and marks[j] is Mark.GRAY for j in range(i))


@pytest.mark.parametrize(
    ("message", "word"),
    [
        ("[crane]", "crane"),
        ("[CRANE]", "crane"),
        ("I think it is [slate] because...", "slate"),
        ("[ crane ]", "crane"),
        ("[abc] then [crane]", "abc"),  # first bracketed token, as in TextArena
        ("crane", None),
        ("", None),
        ("[]", ""),
    ],
)
def test_extract_word(message: str, word: str | None) -> None:
    assert extract_word(message) == word


def _game(target: str = "crane") -> WordleGame:
    return WordleGame(target=target, words=load_word_lists())


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("crane", InvalidReason.MALFORMED),
        ("no guess here", InvalidReason.MALFORMED),
        ("[cran]", InvalidReason.WRONG_LENGTH),
        ("[cranes]", InvalidReason.WRONG_LENGTH),
        ("[]", InvalidReason.WRONG_LENGTH),
        ("[xqzvj]", InvalidReason.NOT_A_WORD),
        ("[cr4ne]", InvalidReason.NOT_A_WORD),
        ("[crâne]", InvalidReason.NOT_A_WORD),
    ],
)
def test_invalid_moves_cost_a_penalty_but_no_guess(message: str, reason: InvalidReason) -> None:
    game = _game()
    result = game.play(message)
    assert result.invalid is reason
    assert result.reward == DEFAULT_REWARDS.invalid
    assert not result.done and not game.done
    assert game.guesses_left == 6 and game.history == []


def test_repeated_guess_is_invalid() -> None:
    game = _game()
    assert game.play("[slate]").invalid is None
    result = game.play("[SLATE]")
    assert result.invalid is InvalidReason.REPEATED
    assert game.guesses_left == 5


def test_win_and_partial_rewards() -> None:
    game = _game("crane")
    first = game.play("[trace]")  # t X, r G, a G, c Y, e G
    assert marks_to_str(first.marks) == "XGGYG"
    assert first.reward == pytest.approx(3 * DEFAULT_REWARDS.green + DEFAULT_REWARDS.yellow)
    assert not first.done
    win = game.play("[crane]")
    assert win.won and win.done and win.reward == DEFAULT_REWARDS.win
    with pytest.raises(GameOverError):
        game.play("[slate]")


def test_six_guesses_then_loss() -> None:
    game = _game("crane")
    words = ["slate", "pious", "dumpy", "fight", "bloke", "witty"]
    results = [game.play(f"[{w}]") for w in words]
    assert [r.done for r in results] == [False] * 5 + [True]
    assert not game.won and game.guesses_left == 0
    assert results[-1].reward == DEFAULT_REWARDS.partial(results[-1].marks)


def test_partial_credit_never_outweighs_a_win() -> None:
    best_partial = DEFAULT_REWARDS.partial((Mark.GREEN,) * 4 + (Mark.GRAY,))
    assert 6 * best_partial < DEFAULT_REWARDS.win


def test_too_many_invalid_moves_end_the_game_explicitly() -> None:
    game = WordleGame(target="crane", words=load_word_lists(), max_invalid_moves=3)
    assert not game.play("x").done
    assert not game.play("y").done
    last = game.play("z")
    assert last.done and not last.won and "game is over" in last.invalid_detail


def test_seeded_targets_are_reproducible_and_varied() -> None:
    answers = load_word_lists().answers
    assert target_for_seed(7, answers) == target_for_seed(7, answers)
    assert len({target_for_seed(s, answers) for s in range(50)}) > 40


def test_environment_reset_with_seed_is_reproducible() -> None:
    def play(seed: int) -> list[str]:
        env = WordleEnvironment()
        env.reset(seed=seed)
        return [env.step(WordleAction(message=f"[{w}]")).info["feedback"] for w in ("crane", "pious")]

    assert play(123) == play(123)


def test_word_lists_come_from_packages_and_are_sane() -> None:
    words = load_word_lists()
    assert 1000 < len(words.answers) < 5000
    assert list(words.answers) == sorted(set(words.answers))
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in words.answers)
    assert set(words.answers) <= words.guesses
    for common in ("crane", "slate", "house", "about", "years", "cares"):
        assert common in words.guesses
    for common in ("crane", "house", "water"):
        assert common in words.answers
    assert "xqzvj" not in words.guesses
