"""Small helpers shared by the env tests (no fixtures, no server)."""

from __future__ import annotations

from env_space.wordle import target_for_seed
from env_space.words import load_word_lists


def answer_for(seed: int) -> str:
    """The secret word the server will pick for ``reset(seed=seed)``."""
    return target_for_seed(seed, load_word_lists().answers)


def wrong_guesses(target: str, n: int) -> list[str]:
    """``n`` distinct valid words that are not ``target``, for playing a losing game."""
    return [w for w in load_word_lists().answers if w != target][:n]


def feedback_counts_like_trl(messages: list) -> tuple[int, int] | None:
    """Green/yellow counts the way TRL's Wordle example reads them from observation messages.

    It takes the newest message containing ``Feedback:`` and the last line made only
    of G/Y/X (spaces ignored). Returns None when no feedback message exists.
    """
    for message in reversed(messages):
        content = message["content"] if isinstance(message, dict) else message.content
        if "Feedback:" in content:
            feedback = content.split("Feedback:", 1)[-1]
            for line in reversed([ln.strip() for ln in feedback.split("\n") if ln.strip()]):
                row = line.replace(" ", "")
                if row and all(c in "GYX" for c in row):
                    return row.count("G"), row.count("Y")
            return 0, 0
    return None
