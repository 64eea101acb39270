"""Fixtures that run the real Wordle server as a subprocess on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 90.0


@dataclass
class RunningServer:
    base_url: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log()}"
        assert httpx.get(f"{self.base_url}/health", timeout=10).json() == {"status": "healthy"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir: Path, *extra: str) -> RunningServer:
    port = _free_port()
    log_path = log_dir / f"env-server-{port}.log"
    log_file = open(log_path, "wb")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "env_space",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ],
        cwd=REPO,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "NO_PROXY": "127.0.0.1,localhost"},
    )
    log_file.close()
    srv = RunningServer(base_url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during startup:\n{srv.log()}")
        try:
            if httpx.get(f"{srv.base_url}/health", timeout=2).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(srv)
    raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT_S}s:\n{srv.log()}")


def stop_server(srv: RunningServer) -> None:
    if srv.proc.poll() is None:
        srv.proc.terminate()
        try:
            srv.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait(timeout=5)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The server as a Space runs it (web page included), shared by most tests."""
    srv = start_server(tmp_path_factory.mktemp("env-server"))
    try:
        yield srv
        srv.assert_alive()  # nothing the tests sent may have taken it down
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """At most three live sessions."""
    srv = start_server(tmp_path_factory.mktemp("env-capped"), "--max-sessions", "3", "--no-web")
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def expiring_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Sessions idle for more than one second are reaped."""
    srv = start_server(tmp_path_factory.mktemp("env-expiring"), "--session-timeout", "1", "--no-web")
    try:
        yield srv
    finally:
        stop_server(srv)
