"""Start a rollout replica (``python -m rollout_space``) as a child process.

The demo, the rollout tests and the pause benchmark all drive real replicas this one way.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from shared.process import ServerProcess, free_port

__all__ = ["Replica", "free_port"]


class Replica(ServerProcess):
    """A real rollout server on loopback."""

    def __init__(self, model: str | Path, store: str | Path, *, log_path: Path, token: str | None = None,
                 extra: Sequence[str] = (), env: Mapping[str, str] | None = None, port: int | None = None):
        self.model, self.token = str(model), token
        port = port or free_port()
        super().__init__([sys.executable, "-m", "rollout_space", "--model", self.model, "--store", str(store),
                          "--host", "127.0.0.1", "--port", str(port), *extra],
                         port=port, log_path=log_path,
                         env={**(env or {}), **({"DELTASYNC_TOKEN": token} if token else {})})
