"""A small Gradio page at ``/web`` where a person can play Wordle.

Each browser session holds its own in-process ``WordleEnvironment`` (the same
class the API serves, so rules, messages and rewards match), kept in
``gr.State``. It does not count against the API's session cap: the page is a
demo, not a client.
"""

from __future__ import annotations

import html

import gradio as gr
from fastapi import FastAPI

from env_space.environment import WordleEnvironment
from env_space.models import WordleAction, WordleObservation
from env_space.wordle import MAX_GUESSES
from env_space.words import WORD_LENGTH

_COLORS = {"G": "#6aaa64", "Y": "#c9b458", "X": "#787c7e"}

CSS = """
.wordle-board { display: grid; gap: 6px; justify-content: center; margin: 8px 0; }
.wordle-row { display: grid; grid-template-columns: repeat(5, 52px); gap: 6px; }
.wordle-tile { width: 52px; height: 52px; display: flex; align-items: center;
  justify-content: center; font: bold 26px sans-serif; text-transform: uppercase;
  color: #fff; border: 2px solid #3a3a3c; box-sizing: border-box; }
.wordle-tile[data-mark="empty"] { color: inherit; background: transparent; }
"""


def render_board(env: WordleEnvironment | None) -> str:
    """HTML grid of the guesses so far; each tile carries ``data-mark`` G/Y/X/empty."""
    game = env.game if env is not None else None
    history = game.history if game is not None else []
    rows = []
    for r in range(MAX_GUESSES):
        tiles = []
        for c in range(WORD_LENGTH):
            if r < len(history):
                word, marks = history[r]
                mark = marks[c].value
                style = f' style="background:{_COLORS[mark]};border-color:{_COLORS[mark]}"'
                letter = html.escape(word[c])
            else:
                mark, style, letter = "empty", "", ""
            tiles.append(f'<div class="wordle-tile" data-mark="{mark}"{style}>{letter}</div>')
        rows.append(f'<div class="wordle-row" data-row="{r}">{"".join(tiles)}</div>')
    return f'<div class="wordle-board" id="wordle-board">{"".join(rows)}</div>'


def _status(env: WordleEnvironment | None, obs: WordleObservation | None = None) -> str:
    if env is None or env.game is None:
        return "Press **New game** to start."
    if obs is None:
        text = f"New game: guess the {WORD_LENGTH}-letter word in {MAX_GUESSES} tries."
    else:
        # The game's reply to the last move: the messages after the echoed player text.
        replies: list[str] = []
        for msg in reversed(env.entries):
            if msg.category == "PLAYER_ACTION":
                break
            replies.append(msg.content)
        text = "\n\n".join(reversed(replies)).replace("\n", "  \n")
        text += f"\n\nReward for that move: **{obs.reward or 0.0:+.2f}**"
    if env.game.done:
        text += "\n\nPress **New game** to play again."
    return text


def new_game(seed: float | None) -> tuple[WordleEnvironment, str, str, str]:
    env = WordleEnvironment()
    env.reset(seed=int(seed) if seed is not None else None)
    return env, render_board(env), _status(env), ""


def play(text: str, env: WordleEnvironment | None) -> tuple[WordleEnvironment | None, str, str, str]:
    if env is None or env.game is None:
        return env, render_board(env), _status(env), text
    if env.game.done:
        return env, render_board(env), "This game is over. Press **New game** to play again.", ""
    move = text.strip()
    if "[" not in move:
        move = f"[{move}]"  # people type the bare word; the protocol wants brackets
    obs = env.step(WordleAction(message=move))
    return env, render_board(env), _status(env, obs), ""


def build_web_app() -> gr.Blocks:
    with gr.Blocks(title="Wordle", analytics_enabled=False) as demo:
        gr.Markdown(
            "# Wordle\nGuess the secret word. Green: right letter, right spot. "
            "Yellow: in the word, elsewhere. Gray: not in the word."
        )
        env_state = gr.State(None)
        with gr.Row():
            seed = gr.Number(
                value=None,
                label="Seed (optional, same seed = same word)",
                precision=0,
                minimum=0,
                elem_id="seed",
            )
            new_btn = gr.Button("New game", variant="secondary", elem_id="new-game")
        board = gr.HTML(render_board(None), elem_id="board")
        with gr.Row():
            guess = gr.Textbox(label="Your guess", placeholder="crane", max_lines=1, elem_id="guess")
            guess_btn = gr.Button("Guess", variant="primary", elem_id="submit")
        status = gr.Markdown(_status(None), elem_id="status")

        new_btn.click(new_game, inputs=[seed], outputs=[env_state, board, status, guess])
        guess_btn.click(play, inputs=[guess, env_state], outputs=[env_state, board, status, guess])
        guess.submit(play, inputs=[guess, env_state], outputs=[env_state, board, status, guess])
    return demo


def mount_web(app: FastAPI, path: str = "/web") -> FastAPI:
    """Mount the page on ``app`` (no SSR node server, no analytics: the Space is offline-safe)."""
    # System fonts: the default theme would fetch web fonts, which an offline host cannot.
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    return gr.mount_gradio_app(app, build_web_app(), path=path, css=CSS, theme=theme, ssr_mode=False)
