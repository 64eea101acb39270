"""Real rollout servers (``python -m rollout_space``, vLLM on CPU) for the reliability suite.

The launch pattern of ``tests/rollout/conftest.py`` (same engine arguments, token and shared map
cache), kept here because a test folder may not import another folder's conftest. Adds what the
fault tests need: a worker extension named by module path (``tests/`` goes on the server's
PYTHONPATH so it can import ``reliability.fault_worker``), extra environment, and a SIGKILL of the
server's whole process tree, engine core included, as a crash would leave it.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import psutil

from trainer_space.replica_process import Replica, free_port

TESTS = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 240.0
TOKEN = "test-token"
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

    def version(self) -> dict:
        r = self.get("/version")
        assert r.status_code == 200, r.text
        return r.json()

    def live_digest(self) -> dict:
        """The digest of the live engine weights, read again now (not a cached one)."""
        r = self.get("/weights/digest", params={"fresh": "true"}, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, prompt: str = "The quick brown", max_tokens: int = 8, **kw) -> dict:
        r = self.post("/v1/completions", json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, "logprobs": 1, "return_token_ids": True,
                                               **kw})
        assert r.status_code == 200, r.text
        return r.json()


def launch(model: Path, store: Path | str, workdir: Path, *extra: str, map_cache: Path | None = None,
           env: Mapping[str, str] | None = None, port: int | None = None) -> Server:
    """Start a server; call :func:`wait_ready` before using it (lets several start at once).
    ``workdir`` holds its downloads (``--work-dir``), log and vLLM cache: a restart on the same
    ``workdir`` finds what the previous process left there. Maps are cached in ``map_cache``
    (default: ``maps`` beside ``workdir``), so later servers skip probing."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"rollout-{port}.log"
    for k in itertools.count(1):  # a restart on the same port keeps its predecessor's log
        if not log.exists():
            break
        log = workdir / f"rollout-{port}.{k}.log"
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {"VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "TOKENIZERS_PARALLELISM": "false",
                "DELTASYNC_MAP_CACHE": str(map_cache or workdir.parent / "maps"), "PYTHONPATH": pythonpath, **(env or {})}
    return Server(model, store, log_path=log, token=TOKEN, env=full_env, port=port,
                  extra=["--work-dir", str(workdir / "objects"), *ENGINE_ARGS, *extra])


def wait_ready(server: Server) -> Server:
    """Ready, or an error that shows the server's log without its flood of health checks."""
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
    except (TimeoutError, RuntimeError) as e:
        lines = [ln for ln in server.log().splitlines() if '"GET /health HTTP/1.1"' not in ln]
        raise type(e)(f"{str(e).splitlines()[0]}\n{server.log_path}:\n" + "\n".join(lines[-80:])) from None
    return server


def kill_tree(server: Server, timeout: float = 60.0) -> set[int]:
    """SIGKILL the server and every process under it (the engine core, multiprocessing helpers),
    stopped first so that none of them reacts to another's death; returns their pids once all are
    gone. The server shares the test's process group, so the group is the server's tree."""
    root = psutil.Process(server.proc.pid)
    procs = [root, *root.children(recursive=True)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    server.proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while alive := [p for p in procs if _alive(p)]:
        assert time.monotonic() < deadline, f"still alive after SIGKILL: {[p.pid for p in alive]}"
        time.sleep(0.05)
    return {p.pid for p in procs}


def _alive(p: psutil.Process) -> bool:
    """A killed child of a process that is gone may linger as a zombie until something reaps it."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
