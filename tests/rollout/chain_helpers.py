"""Build version chains and checkpoints for the rollout tests (trainer side, no engine)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from shared.chain import Chain, reconstruct
from shared.checkpoint import load_state, save_state
from shared.publisher import DeltaPublisher
from shared.stores import open_store


class FakeTrainer:
    """fp32 master weights that take sign-SGD steps (Adam-like magnitudes), published as bf16."""

    def __init__(self, model_dir: Path, store: str, *, lr: float = 2e-3, seed: int = 0,
                 replicas: list[str] = (), token: str | None = None):
        self.master = {n: t.float() for n, t in load_state(model_dir).items()}
        self.gen = torch.Generator().manual_seed(seed)
        self.lr = lr
        self.publisher = DeltaPublisher(self.master, store, external_base=str(model_dir),
                                        replicas=list(replicas), token=token)

    def step(self):
        with torch.no_grad():
            for t in self.master.values():
                t.add_(torch.randn(t.shape, generator=self.gen).sign_() * self.lr)
        return self.publisher.publish()

    def close(self) -> None:
        self.publisher.close()


def checkpoint_dir(model_dir: Path, store: str, version: int, out: Path) -> Path:
    """A loadable model folder holding the chain's state at ``version``."""
    state, _ = reconstruct(Chain(open_store(store)), version)
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    save_state(state, out / "model.safetensors")
    return out
