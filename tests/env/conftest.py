"""Fixtures that run the real Wordle server as a subprocess on a free loopback port."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.process import ServerProcess, free_port

STARTUP_TIMEOUT_S = 90.0


class RunningServer(ServerProcess):
    """The Wordle server (``python -m env_space``) on a free loopback port."""

    def __init__(self, log_dir: Path, *extra: str):
        port = free_port()
        super().__init__([sys.executable, "-m", "env_space", "--host", "127.0.0.1", "--port", str(port),
                          "--log-level", "warning", *extra],
                         port=port, log_path=log_dir / f"env-server-{port}.log",
                         env={"GRADIO_ANALYTICS_ENABLED": "False", "NO_PROXY": "127.0.0.1,localhost"})

    @property
    def base_url(self) -> str:
        return self.url

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log()}"
        assert httpx.get(f"{self.url}/health", timeout=10).json() == {"status": "healthy"}


def start_server(log_dir: Path, *extra: str) -> RunningServer:
    return RunningServer(log_dir, *extra).wait_ready(STARTUP_TIMEOUT_S)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The server as a Space runs it (web page included), shared by most tests."""
    srv = start_server(tmp_path_factory.mktemp("env-server"))
    try:
        yield srv
        srv.assert_alive()  # nothing the tests sent may have taken it down
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """At most three live sessions."""
    srv = start_server(tmp_path_factory.mktemp("env-capped"), "--max-sessions", "3", "--no-web")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def expiring_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Sessions idle for more than one second are reaped."""
    srv = start_server(tmp_path_factory.mktemp("env-expiring"), "--session-timeout", "1", "--no-web")
    try:
        yield srv
    finally:
        srv.stop()
