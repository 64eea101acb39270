"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3 model (tied embeddings), built once per session."""
    from shared.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def chromium() -> dict:
    """Playwright launch options for Debian's chromium (never a browser Playwright downloads);
    its absence fails the test."""
    assert CHROMIUM.exists(), "needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"
    return {"executable_path": str(CHROMIUM), "args": CHROMIUM_ARGS, "headless": True}
