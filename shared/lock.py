"""One writer per store: a lock object that a writer creates exclusively and keeps renewed.

Two writers interleaving uploads leave a chain whose manifests and objects disagree, so every
writer (``DeltaPublisher``, ``deltasync push``/``squash``/``fsck --repair``) holds
``writer.lock`` for as long as it writes. The lock names its holder and is renewed every
``ttl_s / 4``; one whose process is gone (same host) or that was not renewed for ``ttl_s`` is
stale and may be taken over, so a restarted Space does not wait on its dead predecessor. How
exclusive the create is depends on the backend (see :meth:`Store.create`); a takeover or a
renewal racing another writer within one round trip is noticed at the next renewal, and
``Chain.publish`` refuses a version that another writer already published.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from pydantic import BaseModel, ValidationError

from .errors import DeltaError
from .stores import Store

LOCK_KEY = "writer.lock"
log = logging.getLogger("deltasync.lock")


class Holder(BaseModel):
    id: str
    host: str
    pid: int
    command: str
    since: float
    renewed: float
    ttl_s: float

    def describe(self) -> str:
        age = time.time() - self.since
        return f"{self.command or 'a writer'} (pid {self.pid} on {self.host}, for {age:.0f} s)"

    def stale(self) -> bool:
        if time.time() - self.renewed > self.ttl_s:
            return True
        return self.host == socket.gethostname() and not process_alive(self.pid)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(store: Store) -> Holder | None:
    try:
        return Holder.model_validate_json(store.get(LOCK_KEY))
    except DeltaError:  # no lock
        return None
    except ValidationError:  # a damaged lock object holds nothing
        return Holder(id="?", host="?", pid=0, command="an unreadable lock", since=0, renewed=0, ttl_s=0)


class WriterLock:
    """``with WriterLock(store, "deltasync push"):`` writes as the store's only writer."""

    def __init__(self, store: Store, command: str = "", ttl_s: float = 120.0):
        self.store, self.ttl_s = store, ttl_s
        now = time.time()
        self.me = Holder(id=uuid.uuid4().hex, host=socket.gethostname(), pid=os.getpid(), command=command,
                         since=now, renewed=now, ttl_s=ttl_s)
        self.lost: str | None = None  # why the lock is no longer ours
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> WriterLock:
        for _ in range(3):
            if self.store.create(LOCK_KEY, self.me.model_dump_json().encode()):
                self._renewer = threading.Thread(target=self._renew_loop, name="deltasync-lock", daemon=True)
                self._renewer.start()
                return self
            holder = read_holder(self.store)
            if holder is None:
                continue  # released in between
            if not holder.stale():
                raise DeltaError("locked", f"{self.store.uri} already has a writer: {holder.describe()}. "
                                 "Two writers would corrupt the chain; wait for it to finish, or if it is gone "
                                 f"run `deltasync fsck {self.store.uri} --break-lock`")
            # Delete only the stale lock we read: a contender may have replaced it meanwhile. (A window
            # of one round trip remains; the loser notices at its first renewal, in ttl_s / 4.)
            again = read_holder(self.store)
            if again is not None and again.id == holder.id:
                log.warning("%s: taking over the stale writer lock of %s", self.store.uri, holder.describe())
                self.store.delete(LOCK_KEY)
        raise DeltaError("locked", f"{self.store.uri}: could not take the writer lock (contended)")

    def check(self) -> None:
        """Raise before writing when the lock was lost (broken by fsck, or taken over as stale)."""
        if self.lost:
            raise DeltaError("locked", f"{self.store.uri}: {self.lost}; stopped writing")

    def renew(self) -> None:
        holder = read_holder(self.store)
        if holder is None or holder.id != self.me.id:
            self.lost = ("the writer lock was taken by " + holder.describe()) if holder else "the writer lock vanished"
            return
        self.me.renewed = time.time()
        self.store.put(LOCK_KEY, self.me.model_dump_json().encode())

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
            holder = read_holder(self.store)
            if holder is not None and holder.id == self.me.id:
                self.store.delete(LOCK_KEY)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - a store hiccup; the next round retries
                log.warning("%s: renewing the writer lock failed: %s", self.store.uri, e)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def break_lock(store: Store) -> Holder | None:
    """Remove the lock whatever holds it (``deltasync fsck --break-lock``); returns who held it."""
    holder = read_holder(store)
    store.delete(LOCK_KEY)
    return holder
