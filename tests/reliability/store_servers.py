"""A real S3 endpoint on loopback (moto's server) and a TCP relay in front of it that the store
fault tests control: an outage, then the same address again; one request held at a gate.

moto keeps its objects in memory, so stopping it would lose the store: an outage is the relay's
port refusing connections (and the open ones cut), which is what clients see when a store goes
away, while the objects stay where they are.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shared.process import REPO, free_port
from shared.stores import Store, open_store

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class MotoServer:
    """``python -m moto.server`` on a free loopback port; ``store()`` opens an ``s3://`` store on it."""

    def __init__(self, log_path: Path, timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:  # moto has no /health: any HTTP answer means it listens
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited with {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                httpx.get(self.url, timeout=1)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"moto did not answer on {self.url} within {timeout:.0f}s") from None
                time.sleep(0.1)

    def store(self, uri: str, endpoint: str | None = None) -> Store:
        """An S3 store reached at ``endpoint`` (default: moto itself); the bucket is created."""
        store = open_store(uri, client_kwargs={"endpoint_url": endpoint or self.url})
        bucket = uri.removeprefix("s3://").split("/", 1)[0]
        if not store.fs.exists(bucket):
            store.fs.mkdir(bucket)
        return store

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@dataclass
class Hold:
    """The first request whose bytes contain ``pattern`` waits here: ``hit`` is set when it
    arrives, and it goes on to the server once ``release`` is set."""

    pattern: bytes
    hit: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class TcpProxy:
    """A TCP relay on a fixed loopback port to ``upstream_port``.

    ``down()`` is an outage: the port refuses connections and every open one is cut; ``up()``
    listens on the same port again. ``hold(pattern)`` stops one request at the relay (see
    :class:`Hold`): a client that planned something can be made to fetch it only after the store
    changed underneath. ``requests`` counts the client connections accepted.
    """

    def __init__(self, upstream_port: int):
        self.port, self.upstream = free_port(), upstream_port
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._holds: list[Hold] = []
        self._listener: socket.socket | None = None
        self.up()

    # ------------------------------------------------------------------ control
    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), name=f"proxy-{self.port}", daemon=True).start()

    def down(self) -> None:
        s, self._listener = self._listener, None
        if s is not None:
            _cut(s)  # shutdown wakes the accept() blocked on it
        with self._lock:
            conns, self._open = list(self._open), set()
        for c in conns:
            _cut(c)

    def hold(self, pattern: bytes) -> Hold:
        h = Hold(pattern)
        with self._lock:
            self._holds.append(h)
        return h

    def close(self) -> None:
        self.down()
        with self._lock:
            for h in self._holds:
                h.release.set()

    # ------------------------------------------------------------------ relay
    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # down()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                _cut(client)
                continue
            with self._lock:
                self.accepted += 1
                self._open |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if requests:
                    self._maybe_hold(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _cut(s)
            with self._lock:
                self._open -= {src, dst}

    def _maybe_hold(self, data: bytes) -> None:
        with self._lock:
            h = next((h for h in self._holds if not h.hit.is_set() and h.pattern in data), None)
            if h is not None:
                h.hit.set()
        if h is not None:
            h.release.wait()


def _cut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
