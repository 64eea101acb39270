"""One run log for the monitoring UI and the report: versions, replicas, training, the env.

Everything it shows can be read from outside the trainer: the store's manifests (what each
version cost), each replica's ``/version`` and ``/weights/digest`` (what it serves, and whether
that is bit-exact), the env Space's ``/stats``. So a run from any trainer (the custom-trainer
example, a script that calls ``deltasync push``) is monitored the same way by attaching to its
store and replicas. When the trainer runs in this process it adds what only it knows: reward and
loss per optimizer step, and encode / upload times per version (``PublishReport``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import httpx

from shared.chain import Chain
from shared.publisher import PublishReport
from shared.stores import open_store


@dataclass
class ReplicaView:
    url: str
    version: int | None = None
    status: str = "unreachable"
    error: str = ""


@dataclass
class VersionRow:
    version: int
    state_digest: str
    kind: str = ""
    changed: int = 0
    numel: int = 0
    payload_bytes: int = 0
    dense_bytes: int = 0
    encode_s: float | None = None  # how long publish() held the training loop
    encoder_s: float | None = None  # the publisher's encoder thread, while the next step trains
    upload_s: float | None = None
    stage_s: float | None = None  # the slowest replica's, while serving
    pause_s: float | None = None  # the slowest replica's generation pause
    reward: float | None = None  # mean reward of the optimizer step that produced this version
    loss: float | None = None
    games: int | None = None  # games the env had started when this version was checked
    state_fingerprint: str = ""
    # url -> the identity (see below) that replica computed from its live weights at this version
    live: dict[str, str] = field(default_factory=dict)

    @property
    def int32_bf16_bytes(self) -> int:
        return 6 * self.changed

    @property
    def identity(self) -> str:
        """What a replica's live weights are checked against: the blake3 state digest, or the
        state fingerprint for a version published without digests (``digests="anchors"``)."""
        return self.state_digest or self.state_fingerprint

    @property
    def exact(self) -> bool | None:
        """True once every replica that served this version matched it; None before any did."""
        if not self.live:
            return None
        return all(d == self.identity for d in self.live.values())

    def as_dict(self) -> dict:
        return asdict(self) | {"int32_bf16_bytes": self.int32_bf16_bytes, "exact": self.exact,
                               "identity": self.identity, "changed_fraction": self.changed / max(self.numel, 1)}


class Monitor:
    """Thread-safe: the publisher's upload thread, trl's callbacks and the UI's timer all call it."""

    def __init__(self, store: str | None = None, replicas: Sequence[str] = (), env_url: str | None = None,
                 timeout_s: float = 10.0):
        self.store_uri, self.env_url = store, env_url
        self.replicas = {u.rstrip("/"): ReplicaView(u.rstrip("/")) for u in replicas}
        self.versions: dict[int, VersionRow] = {}
        self.steps: list[dict] = []  # one per optimizer step: step, reward, loss, ...
        self.env_stats: dict = {}
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=timeout_s)
        self._chain = Chain(open_store(store)) if store else None

    # ------------------------------------------------------------------ what the trainer reports
    def on_report(self, report: PublishReport) -> None:
        """A version finished uploading (publisher thread)."""
        steps = [s for answer in report.replicas.values() for s in answer.get("steps", [])]
        with self._lock:
            row = self.versions.setdefault(report.version, VersionRow(report.version, report.state_digest))
            row.state_digest, row.state_fingerprint = report.state_digest, report.state_fingerprint
            row.kind, row.changed, row.numel = report.kind, report.changed, report.numel
            row.payload_bytes, row.dense_bytes = report.payload_bytes, report.dense_bytes
            row.encode_s, row.encoder_s, row.upload_s = report.encode_s, report.encoder_s, report.upload_s
            if steps:
                row.stage_s = max(s.get("stage_s", 0.0) for s in steps)
                row.pause_s = max(s.get("pause_s", 0.0) for s in steps)

    def on_step(self, step: int, logs: dict) -> None:
        """trl logged an optimizer step (its ``on_log`` callback)."""
        keep = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}
        with self._lock:
            self.steps.append({"step": step, **keep})
            # trl syncs after each step: version 1 is the cold sync, step s produces version s + 1
            row = self.versions.setdefault(step + 1, VersionRow(step + 1, ""))
            row.reward, row.loss = keep.get("reward"), keep.get("loss")

    # ------------------------------------------------------------------ what anyone can read
    def refresh(self) -> None:
        """Read the store's new manifests, every replica's version (checking the live digest of a
        version not yet checked) and the env's stats. Called by the UI's timer and after each sync."""
        self._read_store()
        for view in list(self.replicas.values()):
            self._read_replica(view)
        if self.env_url:
            try:
                self.env_stats = self._http.get(f"{self.env_url.rstrip('/')}/stats").json()
            except (httpx.HTTPError, ValueError):
                self.env_stats = {}

    def verify(self, version: int) -> dict[str, bool]:
        """Compare every replica's live weights with ``version`` now; url -> exact."""
        self.refresh()
        with self._lock:
            row = self.versions.get(version)
            if row is not None:
                row.games = self.env_stats.get("games_started")
            return {url: row is not None and row.live.get(url) == row.identity for url in self.replicas}

    def _read_store(self) -> None:
        if self._chain is None:
            return
        try:
            latest = self._chain.latest()
        except Exception:  # noqa: BLE001 - a store hiccup must not stop the monitor
            return
        if latest is None:
            return
        for v in range(max(self.versions, default=-1) + 1, latest.version + 1):
            try:
                m = self._chain.manifest(v)
            except Exception:  # noqa: BLE001 - deleted by retention, or not yet visible
                continue
            delta, anchor = m.object("delta"), m.object("anchor")
            with self._lock:
                row = self.versions.setdefault(v, VersionRow(v, m.state_digest))
                row.state_digest, row.state_fingerprint = m.state_digest, m.state_fingerprint
                row.changed, row.numel, row.dense_bytes = m.changed, m.numel, m.dense_bytes
                row.kind = row.kind or ("delta" if delta else "anchor")
                row.payload_bytes = row.payload_bytes or (delta.size if delta else anchor.size if anchor else 0)

    def _read_replica(self, view: ReplicaView) -> None:
        try:
            r = self._http.get(f"{view.url}/version")
            body = r.json()
            view.version, view.status, view.error = body.get("version"), body.get("status", "?"), ""
        except (httpx.HTTPError, ValueError) as e:
            view.status, view.error = "unreachable", f"{type(e).__name__}: {e}"
            return
        with self._lock:
            row = self.versions.get(view.version) if view.version is not None else None
            checked = row is None or view.url in row.live
        if checked:
            return
        try:
            live = self._http.get(f"{view.url}/weights/digest").json()
        except (httpx.HTTPError, ValueError):
            return
        with self._lock:
            row = self.versions.get(live.get("version"))
            if row is not None:
                row.live[view.url] = live["state_digest"] if row.state_digest else live["state_fingerprint"]

    # ------------------------------------------------------------------ views
    def rows(self) -> list[dict]:
        with self._lock:
            return [self.versions[v].as_dict() for v in sorted(self.versions)]

    def step_logs(self) -> list[dict]:
        with self._lock:
            return list(self.steps)

    def replica_views(self) -> list[ReplicaView]:
        return list(self.replicas.values())
