"""Start and stop a rollout replica (``python -m rollout_space``) as a child process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """A real rollout server on loopback, for the demo and tests."""

    def __init__(self, model: Path, store: str, *, token: str, log_path: Path, port: int | None = None,
                 extra: list[str] = ()):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.log = open(log_path, "wb")
        env = {**os.environ, "DELTASYNC_TOKEN": token}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_space", "--model", str(model), "--store", store,
             "--host", "127.0.0.1", "--port", str(self.port), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollout server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"rollout server not ready after {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
