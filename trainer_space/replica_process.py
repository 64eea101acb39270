"""Start and stop a rollout replica (``python -m rollout_space``) as a child process.

The demo, the rollout tests and the pause benchmark all drive real servers this one way.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """A real rollout server on loopback. Its output goes to a file, never a pipe (a full pipe
    would block the server)."""

    def __init__(self, model: str | Path, store: str | Path, *, log_path: Path, token: str | None = None,
                 extra: Sequence[str] = (), env: Mapping[str, str] | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model, self.token, self.log_path = str(model), token, log_path
        cmd = [sys.executable, "-m", "rollout_space", "--model", self.model, "--store", str(store),
               "--host", "127.0.0.1", "--port", str(self.port), *extra]
        env = {**os.environ, **(env or {}), **({"DELTASYNC_TOKEN": token} if token else {})}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> Replica:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollout server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"rollout server not ready after {timeout:.0f}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
