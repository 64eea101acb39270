"""Real env and rollout servers for the trainer tests: the embedded defaults' own launcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_space.local import LocalServices, build_policy

STEPS = 3  # optimizer steps per training test: versions 1 (cold) .. STEPS + 1


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> Path:
    """The local Wordle policy (Qwen3 with trl's template, tool-call warm-up), built once."""
    return build_policy(tmp_path_factory.mktemp("policy") / "model")


@pytest.fixture
def services(policy_dir: Path, tmp_path: Path):
    """A fresh env Space and rollout Space on loopback, with an empty bucket."""
    with LocalServices(tmp_path / "run", policy_dir) as s:
        yield s
