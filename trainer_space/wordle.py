"""Wordle as a trl ``environment_factory``: one game per rollout, played through the env Space.

trl makes one instance per rollout in its rollout process, calls ``reset()`` (whose text joins
the prompt), offers every public method as a tool (here: ``guess``), and scores the rollout with
``get_reward()``. The game runs on the env Space, reached with OpenEnv's WebSocket client.

The reading of observations follows trl's own Wordle example against OpenEnv's TextArena
server: ``messages[0].content`` is the whole conversation so far, the text a move appended is
the feedback, and a move whose feedback says "You attempted an invalid move" earns 0.
"""

from __future__ import annotations

from env_space.client import WordleEnv
from env_space.models import WordleAction

INVALID_MOVE = "You attempted an invalid move"

PROMPT = ("Play Wordle: find the secret 5-letter English word in 6 guesses. After each guess the game marks "
          "every letter G (right place), Y (in the word, wrong place) or X (not in the word). "
          "Call the tool `guess` with a word in square brackets, e.g. [crane].")


class WordleGame:
    """A picklable factory product: ``functools.partial(WordleGame, env_url)`` is the factory."""

    def __init__(self, env_url: str):
        self.env_url = env_url
        self._client = None
        self._seen = ""
        self.reward, self.done, self.won = 0.0, False, False

    def reset(self, **kwargs) -> str:
        if self._client is None:
            self._client = WordleEnv(base_url=self.env_url).sync()
            self._client.connect()
        result = self._client.reset()
        self._seen = result.observation.messages[0].content
        self.reward, self.done, self.won = 0.0, False, False
        return self._seen

    def guess(self, guess: str) -> str:
        """Guess the secret word.

        Args:
            guess: a five-letter English word in square brackets, e.g. "[crane]".

        Returns:
            The game's feedback on this guess.
        """
        if self.done:
            raise ValueError("The game is over.")
        result = self._client.step(WordleAction(message=guess))
        text = result.observation.messages[0].content
        feedback, self._seen = text[len(self._seen):], text
        self.reward = 0.0 if INVALID_MOVE in feedback else float(result.reward or 0.0)
        self.done = bool(result.done)
        self.won = bool(result.observation.info.get("won"))
        return feedback

    def get_reward(self) -> float:
        return self.reward

    def __getstate__(self) -> dict:
        return {"env_url": self.env_url}  # a live WebSocket does not cross processes

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["env_url"])
