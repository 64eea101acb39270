"""trl's Wordle example reads our env exactly as it reads OpenEnv's TextArena server."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from env_space.words import load_word_lists
from trainer_space.local import EnvServer
from trainer_space.wordle import INVALID_MOVE, WordleGame


@pytest.fixture(scope="module")
def env_url(tmp_path_factory):
    with EnvServer(tmp_path_factory.mktemp("env") / "env.log") as s:
        yield s.wait_ready(120).url


def test_feedback_is_the_text_each_move_appends(env_url: str):
    game = pickle.loads(pickle.dumps(WordleGame(env_url)))  # trl pickles the factory into its rollout process
    first = game.reset()
    assert first.startswith("\n[GAME] You are Playing Wordle.") and first.endswith("Enter your guess to begin.\n")

    invalid = game.guess("crane")  # no brackets
    assert invalid.startswith("\n[GAME] crane\n[GAME] " + INVALID_MOVE)
    assert game.reward == 0.0 and not game.done  # the example scores an invalid move 0

    ok = game.guess("[crane]")
    assert ok.startswith("\n[GAME] [crane]\n[GAME] You submitted [crane].\nFeedback:\nC R A N E\n")
    assert ok.endswith("You have 5 guesses left.") and INVALID_MOVE not in ok
    assert game.get_reward() >= 0.0


def test_a_finished_game_refuses_more_guesses_and_the_env_counts_it(env_url: str):
    import httpx

    game = WordleGame(env_url)
    game.reset()
    for word in load_word_lists().answers[:6]:  # six valid guesses always end a game
        feedback = game.guess(f"[{word}]")
        if game.done:
            break
    assert game.done and ("Congratulations" in feedback or "The secret word was" in feedback)
    with pytest.raises(ValueError, match="over"):
        game.guess("[crane]")
    stats = httpx.get(f"{env_url}/stats").json()
    assert stats["games_won"] + stats["games_lost"] >= 1 and stats["guesses"] >= 1


def test_the_policy_prompt_is_what_trl_renders(tmp_path: Path):
    """The warm-up prompt and trl's rollout prompt must agree, or the policy never calls the tool."""
    from transformers import AutoTokenizer

    from trainer_space.local import qwen3_chat_template, wordle_prompts
    from shared.tiny_model import build_tiny_model

    build_tiny_model(tmp_path, chat_template=qwen3_chat_template())
    (prompt,) = wordle_prompts(AutoTokenizer.from_pretrained(tmp_path))
    assert '"name": "guess"' in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
