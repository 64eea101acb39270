"""HTTP bodies of the rollout server's control endpoints, shared by the server and its callers.

Pydantic models only (no web framework): the trainer's publisher, the CLI, tests and notebooks
build and parse these without importing FastAPI.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PauseMode = Literal["wait", "keep", "abort"]


class UpdateRequest(BaseModel):
    """``POST /update``. ``version`` None: the store's latest. Unknown fields are refused: a typo
    such as ``verison`` would otherwise read as "the latest" and move the replica."""

    model_config = ConfigDict(extra="forbid")

    version: int | None = Field(None, ge=0)
    # How requests in flight at the moment of the write are handled: "wait" lets them finish
    # on the old weights (every response then comes from one version), "keep" freezes them and
    # continues them on the new weights (their responses list both versions), "abort" ends them.
    mode: PauseMode = "wait"


class StepReport(BaseModel):
    """One object applied (or refused) on the way to the target version."""

    version: int
    kind: Literal["anchor", "delta", "external"]
    base_version: int | None = None
    bytes: int = 0
    changed: int = 0
    download_s: float = 0.0
    stage_s: float = 0.0  # decode, gather, predict: while serving
    drain_s: float = 0.0  # waiting for in-flight requests (mode "wait")
    pause_s: float = 0.0  # generation stopped: write + cache reset + resume
    write_s: float = 0.0  # the write itself, inside the engine
    audit_s: float = 0.0  # read-back check, while serving again


class Refusal(BaseModel):
    reason: str  # shared.errors.Reason, or "busy" / "internal"
    message: str
    version: int | None = None  # the version that was refused


class UpdateResponse(BaseModel):
    version: int | None  # the version served now
    commitment: str
    state_digest: str  # blake3, from the version's manifest ("" when it has none)
    state_fingerprint: str = ""
    target: int | None = None
    steps: list[StepReport] = []
    refused: Refusal | None = None
    total_s: float = 0.0
    accepted: bool = True  # False when the update was refused
    write_probe: dict | None = None  # the write-through probe after a dense load (--write-probe dense)


class VersionResponse(BaseModel):
    version: int | None
    commitment: str
    state_digest: str  # blake3, from the version's manifest ("" when it has none)
    state_fingerprint: str = ""
    status: Literal["starting", "ready", "updating", "damaged"]
    model: str
    store: str
    latest_seen: int | None = None
    damage: str = ""  # why, when status is "damaged"
    write_probe: dict | None = None  # the last write-through probe's summary


class DigestResponse(BaseModel):
    """State digest and fingerprint computed from the live engine weights, in checkpoint
    coordinates. ``matches_held``: every tensor is what the held version says, by its blake3
    digest where the replica knows it, else by its fingerprint (tensors touched by deltas
    published without digests); ``mismatched`` names the others."""

    version: int | None
    commitment: str
    state_digest: str
    state_fingerprint: str
    matches_held: bool
    mismatched: list[str] = []
    seconds: float  # how long the computation took (the original one, when cached)
    # True: computed earlier for these same weights (no write since) and served from the cache;
    # ``?fresh=true`` (bearer token) never returns a cached value (it may share a computation that
    # is already reading these same weights).
    cached: bool = False


class HealthResponse(BaseModel):
    status: Literal["ok", "starting", "damaged", "dead"]
    version: int | None = None
