"""A server as a child process on loopback: started, waited for, stopped.

The demo, the benchmarks and the tests all run the project's servers as real processes; this is
the one way they do it. Output goes to a file, never a pipe (a full pipe would block the server).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


_PORTS = random.SystemRandom()  # not the global generator, which a test may seed alike in every worker


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port that is free now, from below the kernel's ephemeral range. A port the
    kernel hands out (``bind(0)``) is released before the server binds it, and a server that
    starts a vLLM engine first takes a minute to bind: meanwhile the kernel can give the same
    port to someone else's ``bind(0)`` or outgoing connection (vLLM's own ZMQ ports, another
    test worker), and the server exits with "Address already in use" (seen in CI). Ports below
    the range are never handed out that way; only another ``free_port`` can pick the same one,
    one chance in thousands."""
    low = _ephemeral_low()
    for _ in range(100):
        port = _PORTS.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free loopback port found")


def wait_healthy(url: str, timeout: float, *, check: Callable[[], None] = lambda: None) -> None:
    """Poll ``GET {url}/health`` until it answers 200; ``check`` runs before each try and may raise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        try:
            if httpx.get(f"{url.rstrip('/')}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")


class ServerProcess:
    """``cmd`` serving on ``127.0.0.1:port``; ready once ``GET /health`` answers 200."""

    def __init__(self, cmd: Sequence[str], *, port: int, log_path: Path,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None):
        self.port, self.log_path = port, log_path
        self.url = f"http://127.0.0.1:{port}"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(list(cmd), cwd=cwd or REPO, env={**os.environ, **(env or {})},
                                         stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0):
        def alive() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[2:3]} exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")

        try:
            wait_healthy(self.url, timeout, check=alive)
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"not healthy after {timeout:.0f}s:\n{self.log()[-4000:]}") from None
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
