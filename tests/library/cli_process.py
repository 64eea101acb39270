"""``deltasync`` commands for the tests, each in its own process forked from one zygote
(``cli_zygote.py``: same CLI, a process per command, without a cold start each time). A command
whose ``HF_*`` settings differ from the zygote's starts cold, since huggingface_hub reads them
once, at import."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_lock = threading.Lock()
_zygote: subprocess.Popen | None = None
_replies: queue.Queue = queue.Queue()


def isolated_env(**extra: str) -> dict[str, str]:
    """No credentials, no terminal width, nothing that reaches a network."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "HF_", "DELTASYNC_")) and k not in ("COLUMNS", "LINES", "SPACE_ID")}
    env |= {"PYTHONPATH": str(ROOT), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true",
            "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return env | extra


def _import_time(env: Mapping[str, str]) -> dict[str, str]:
    """The settings huggingface_hub reads once, at import (endpoint, offline mode, ...)."""
    return {k: v for k, v in env.items() if k.startswith("HF_")}


def _start() -> subprocess.Popen:
    global _zygote, _replies
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py"))], cwd=ROOT,
                                   env=isolated_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _replies = queue.Queue()
        threading.Thread(target=lambda out, q: [q.put(json.loads(line)) for line in out],
                         args=(_zygote.stdout, _replies), daemon=True).start()
    return _zygote


def run_cli(args, *, cwd: str | Path = ROOT, env: Mapping[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m shared.cli ARGS`` in ``cwd`` with ``env`` (default: this process's), as
    :func:`subprocess.run` with ``capture_output=True, text=True`` would report it."""
    argv = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    if _import_time(env) != _import_time(isolated_env()):  # the zygote's imports read other settings
        return subprocess.run([sys.executable, "-m", "shared.cli", *argv], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    with _lock, tempfile.TemporaryDirectory(prefix="deltasync-cli-") as tmp:
        z = _start()
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {"argv": argv, "cwd": str(cwd), "env": env,
                   "stdout": str(out), "stderr": str(err)}
        z.stdin.write(json.dumps(request) + "\n")
        z.stdin.flush()
        pid = _replies.get(timeout=60)["pid"]
        try:
            code = _replies.get(timeout=timeout)["code"]
        except queue.Empty:
            os.kill(pid, signal.SIGKILL)
            _replies.get(timeout=60)
            raise subprocess.TimeoutExpired(["deltasync", *argv], timeout) from None
        return subprocess.CompletedProcess(["deltasync", *argv], code, out.read_text(), err.read_text())
