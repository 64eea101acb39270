"""Real rollout servers (``python -m rollout_space``, vLLM on CPU) as subprocesses on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from trainer_space.replica_process import Replica, free_port

STARTUP_TIMEOUT_S = 240.0
TOKEN = "test-token"
ENGINE_ARGS = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20),
               "--max-num-seqs", "16", "--disable-log-stats", "--poll-s", "0"]


class Server(Replica):
    """A replica with the HTTP calls the tests make."""

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


def launch(model: Path, store: Path, workdir: Path, *extra: str, worker: str | None = None,
           env: dict[str, str] | None = None) -> Server:
    """Start a server; call :func:`wait_ready` before using it (lets several start at once).
    ``worker``: a test-only worker extension from this folder (``module.Class``), with ``env``."""
    port = free_port()
    env = {"VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "TOKENIZERS_PARALLELISM": "false",
           "DELTASYNC_MAP_CACHE": str(workdir.parent / "maps"), **(env or {})}
    if worker:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
        extra = (*extra, "--worker-extension-cls", worker)
    return Server(model, store, log_path=workdir / f"rollout-{port}.log", token=TOKEN, env=env, port=port,
                  extra=["--work-dir", str(workdir / f"objects-{port}"), *ENGINE_ARGS, *extra])


def wait_ready(server: Server) -> Server:
    server.wait_ready(STARTUP_TIMEOUT_S)
    return server


@pytest.fixture(scope="session")
def rollout_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rollout")
