"""``deltasync`` commands for the tests, each in its own process forked from one zygote
(``cli_zygote.py``: same CLI, a process per command, without a cold start each time). There is
one zygote per set of ``HF_*`` settings, since huggingface_hub reads them once, at import."""

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
_zygotes: dict[tuple[tuple[str, str], ...], _Zygote] = {}


def isolated_env(**extra: str) -> dict[str, str]:
    """No credentials, no terminal width, nothing that reaches a network."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "HF_", "DELTASYNC_")) and k not in ("COLUMNS", "LINES", "SPACE_ID")}
    env |= {"PYTHONPATH": str(ROOT), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true",
            "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return env | extra


def _import_time(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The settings huggingface_hub reads once, at import (endpoint, offline mode, ...)."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith("HF_")))


class _Zygote:
    """One zygote process and the replies it sends back, for one set of import-time settings."""

    def __init__(self, settings: tuple[tuple[str, str], ...]):
        env = {k: v for k, v in isolated_env().items() if not k.startswith("HF_")} | dict(settings)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py"))], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=lambda out, q: [q.put(json.loads(line)) for line in out],
                         args=(self.proc.stdout, self.replies), daemon=True).start()


def _zygote(settings: tuple[tuple[str, str], ...]) -> _Zygote:
    """The live zygote for these settings, started on first use (or again, if it died)."""
    z = _zygotes.get(settings)
    if z is None or z.proc.poll() is not None:
        z = _zygotes[settings] = _Zygote(settings)
    return z


def run_cli(args, *, cwd: str | Path = ROOT, env: Mapping[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m shared.cli ARGS`` in ``cwd`` with ``env`` (default: this process's), as
    :func:`subprocess.run` with ``capture_output=True, text=True`` would report it."""
    argv = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    with _lock, tempfile.TemporaryDirectory(prefix="deltasync-cli-") as tmp:
        z = _zygote(_import_time(env))
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        z.proc.stdin.write(json.dumps(request) + "\n")
        z.proc.stdin.flush()
        pid = z.replies.get(timeout=60)["pid"]
        try:
            code = z.replies.get(timeout=timeout)["code"]
        except queue.Empty:
            os.kill(pid, signal.SIGKILL)
            z.replies.get(timeout=60)
            raise subprocess.TimeoutExpired(["deltasync", *argv], timeout) from None
        return subprocess.CompletedProcess(["deltasync", *argv], code, out.read_text(), err.read_text())
