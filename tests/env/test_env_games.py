"""Full games against the running server through OpenEnv clients, over /ws and over HTTP."""

from __future__ import annotations

import httpx
import pytest
from openenv.core.generic_client import GenericEnvClient
from wordle_helpers import answer_for, feedback_counts_like_trl, wrong_guesses

from env_space.client import WordleEnv, WordleHTTPEnv
from env_space.models import WordleAction
from env_space.wordle import DEFAULT_REWARDS, marks_to_str, score_guess

CLIENTS = [pytest.param(WordleEnv, id="websocket"), pytest.param(WordleHTTPEnv, id="http")]


@pytest.mark.parametrize("client_cls", CLIENTS)
def test_winning_game(server, client_cls) -> None:
    seed = 11
    target = answer_for(seed)
    opener = wrong_guesses(target, 1)[0]
    with client_cls(base_url=server.base_url).sync() as env:
        result = env.reset(seed=seed)
        obs = result.observation
        assert not result.done
        assert obs.prompt.startswith("You are Playing Wordle.")
        # TextArena's layout: one message, the whole conversation rendered "\n[GAME] <entry>".
        assert [(m.category, m.sender_id) for m in obs.messages] == [("MESSAGE", -1)]
        assert obs.messages[0].content == "\n[GAME] " + obs.prompt

        result = env.step(WordleAction(message=f"I will try [{opener}]"))
        expected = marks_to_str(score_guess(opener, target))
        assert not result.done
        assert result.observation.info["feedback"] == expected
        (last,) = result.observation.messages
        assert last.content.startswith(obs.messages[0].content)  # text is only ever appended
        assert last.content.endswith(f"\n[GAME] I will try [{opener}]\n[GAME] You submitted [{opener}].\nFeedback:\n"
                                     f"{' '.join(opener.upper())}\n{' '.join(expected)}\nYou have 5 guesses left.")
        assert " ".join(expected) in last.content
        assert "You have 5 guesses left." in last.content
        # TRL's Wordle example reads greens/yellows straight from these messages.
        assert feedback_counts_like_trl(result.observation.messages) == (
            expected.count("G"),
            expected.count("Y"),
        )
        assert result.reward == pytest.approx(
            DEFAULT_REWARDS.green * expected.count("G") + DEFAULT_REWARDS.yellow * expected.count("Y")
        )

        result = env.step(WordleAction(message=f"[{target}]"))
        assert result.done and result.reward == DEFAULT_REWARDS.win
        entries = result.observation.messages[0].content.split("\n[GAME] ")
        assert entries[0] == "" and len(entries) == 7  # prompt, then move + answer twice, then the end
        assert entries[-3] == f"[{target}]" and entries[-1].startswith("Congratulations")

        state = env.state()
        assert state.env_id == "Wordle-v0" and state.step_count == 2 and state.turn == 2
        assert state.raw_state["won"] and state.raw_state["secret_word"] == target


@pytest.mark.parametrize("client_cls", CLIENTS)
def test_losing_game_with_invalid_moves(server, client_cls) -> None:
    seed = 12
    target = answer_for(seed)
    guesses = wrong_guesses(target, 6)
    with client_cls(base_url=server.base_url).sync() as env:
        env.reset(seed=seed)
        assert "secret_word" not in env.state().raw_state  # no peeking mid-game

        for bad, reason in [
            ("crane", "malformed"),
            ("[toolong]", "wrong_length"),
            ("[qxzvj]", "not_a_word"),
        ]:
            result = env.step(WordleAction(message=bad))
            assert not result.done and result.reward == DEFAULT_REWARDS.invalid
            assert result.observation.info["invalid_reason"] == reason
            newest = result.observation.messages[0].content.rsplit("\n[GAME] ", 2)
            assert newest[-2] == bad and newest[-1].startswith("You attempted an invalid move. Reason: ")

        env.step(WordleAction(message=f"[{guesses[0]}]"))
        repeat = env.step(WordleAction(message=f"[{guesses[0]}]"))
        assert repeat.observation.info["invalid_reason"] == "repeated"
        assert repeat.observation.info["guesses_left"] == 5

        for word in guesses[1:]:
            result = env.step(WordleAction(message=f"[{word}]"))
        assert result.done and not result.observation.info["won"]
        assert f"The secret word was: **{target}**" in result.observation.messages[-1].content

        state = env.state()
        assert state.raw_state["guesses"] == guesses
        assert state.raw_state["invalid_moves"] == 4
        assert state.step_count == 10 and state.turn == 6

        with pytest.raises(RuntimeError, match="game is over"):
            env.step(WordleAction(message="[crane]"))
        # The session survives the refused step: a reset starts a fresh game.
        again = env.reset(seed=seed + 1)
        assert not again.done and len(again.observation.messages) == 1


@pytest.mark.parametrize("client_cls", CLIENTS)
def test_same_seed_same_game_across_sessions_and_transports(server, client_cls) -> None:
    def feedback(cls) -> list[str]:
        with cls(base_url=server.base_url).sync() as env:
            env.reset(seed=2024)
            return [
                env.step(WordleAction(message=f"[{w}]")).observation.info["feedback"]
                for w in ("crane", "pious", "dumpy")
            ]

    assert (
        feedback(client_cls)
        == feedback(WordleEnv)
        == [marks_to_str(score_guess(w, answer_for(2024))) for w in ("crane", "pious", "dumpy")]
    )


def test_stock_openenv_generic_client_plays_unchanged(server) -> None:
    """A client that knows nothing about this project: OpenEnv's GenericEnvClient with dict actions."""
    target = answer_for(31)
    with GenericEnvClient(base_url=server.base_url).sync() as env:
        result = env.reset(seed=31)
        assert result.observation["prompt"].startswith("You are Playing Wordle.")
        result = env.step({"message": f"[{target}]"})
        assert result.done and result.reward == 1.0
        assert feedback_counts_like_trl(result.observation["messages"]) == (5, 0)
        assert env.state()["raw_state"]["secret_word"] == target


def test_http_session_lifecycle(server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        opened = http.post("/reset", json={"seed": 5, "episode_id": "ep-1"}).json()
        sid = opened["session_id"]
        assert set(opened) == {"observation", "reward", "done", "session_id"}
        assert http.get("/state", params={"session_id": sid}).json()["episode_id"] == "ep-1"

        http.post("/step", json={"session_id": sid, "action": {"message": "[crane]"}}).raise_for_status()
        restarted = http.post("/reset", json={"session_id": sid, "seed": 6}).json()
        assert restarted["session_id"] == sid and len(restarted["observation"]["messages"]) == 1
        assert http.get("/state", params={"session_id": sid}).json()["step_count"] == 0

        # An empty body opens a session too (stock OpenEnv clients send none).
        bare = http.post("/reset")
        assert bare.status_code == 200 and bare.json()["session_id"] != sid

        assert http.post("/close", json={"session_id": sid}).json() == {"session_id": sid, "closed": True}
        assert (
            http.post("/step", json={"session_id": sid, "action": {"message": "[crane]"}}).status_code == 404
        )
        http.post("/close", json={"session_id": bare.json()["session_id"]}).raise_for_status()


def test_schema_health_metadata(server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        assert http.get("/health").json() == {"status": "healthy"}
        schema = http.get("/schema").json()
        assert schema["action"]["required"] == ["message"]
        assert {"prompt", "messages", "current_player_id", "legal_players", "info"} <= set(
            schema["observation"]["properties"]
        )
        assert {"env_id", "turn", "raw_state"} <= set(schema["state"]["properties"])
        assert http.get("/metadata").json()["name"] == "Wordle"
        root = http.get("/", follow_redirects=False)
        assert root.status_code in (302, 307) and root.headers["location"] == "/web/"
        paths = set(http.get("/openapi.json").json()["paths"])
        assert {"/reset", "/step", "/state", "/health", "/schema", "/close", "/sessions"} <= paths
