"""Real rollout replicas (``python -m rollout_space``, vLLM on CPU) for the soak and bad-input tests.

The same launch as ``tests/rollout/conftest.py`` (which a test package cannot import): a
:class:`~trainer_space.replica_process.Replica` on loopback, small engine settings, the
checkpoint->engine maps cached in the session's temporary folder so later replicas skip probing.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from trainer_space.replica_process import Replica, free_port

STARTUP_TIMEOUT_S = 300.0
TOKEN = "reliability-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
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
        return self.post("/update", json=body, headers=AUTH, **kw)

    def live_digest(self) -> dict:
        r = self.get("/weights/digest")
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, prompt: str = "The quick brown", max_tokens: int = 4, **kw) -> dict:
        r = self.post("/v1/completions", json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()


def launch(model: Path, store: Path | str, workdir: Path, *extra: str) -> Server:
    """Start a replica (not yet ready: call ``wait_ready(STARTUP_TIMEOUT_S)``)."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    maps = workdir.parent / "maps"
    env = {"VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "TOKENIZERS_PARALLELISM": "false",
           "DELTASYNC_MAP_CACHE": str(maps)}
    return Server(model, store, log_path=workdir / f"rollout-{port}.log", token=TOKEN, env=env, port=port,
                  extra=["--work-dir", str(workdir / f"objects-{port}"), *ENGINE_ARGS, *extra])
