"""Real rollout servers (``python -m rollout_space``, vLLM on CPU) as subprocesses on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240.0
TOKEN = "test-token"
ENGINE_ARGS = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20),
               "--max-num-seqs", "16", "--disable-log-stats", "--poll-s", "0"]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    model: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=60, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=120, **kw)

    def update(self, version: int | None = None, **kw) -> httpx.Response:
        body = {} if version is None else {"version": version}
        return self.post("/update", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, **kw)

    def complete(self, prompt: str = "The quick brown", max_tokens: int = 8, **kw) -> dict:
        r = self.post("/v1/completions", json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, "logprobs": 1, "return_token_ids": True,
                                               **kw})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: Path, store: Path, workdir: Path, *extra: str) -> Server:
    """Start a server; call :func:`wait_ready` before using it (lets several start at once)."""
    port = free_port()
    log_path = workdir / f"rollout-{port}.log"
    env = os.environ | {"VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "TOKENIZERS_PARALLELISM": "false",
                        "DELTASYNC_MAP_CACHE": str(workdir.parent / "maps")}
    cmd = [sys.executable, "-m", "rollout_space", "--model", str(model), "--store", str(store),
           "--host", "127.0.0.1", "--port", str(port), "--token", TOKEN,
           "--work-dir", str(workdir / f"objects-{port}"), *ENGINE_ARGS, *extra]
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(f"http://127.0.0.1:{port}", proc, log_path, str(model))


def wait_ready(server: Server) -> Server:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def rollout_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rollout")
