"""The engine's state machine under faults (issue 9), driven without vLLM: a fake engine and
fake worker calls record what happens in which order. The replica must always serve one
version, or be openly damaged (and refuse to generate) before generation resumes."""

from __future__ import annotations

import asyncio
from argparse import Namespace
from types import SimpleNamespace

import pytest

from rollout_space.engine import RolloutEngine, version_of
from rollout_space.server import policy_fields
from shared.errors import DeltaError
from shared.schemas import StepReport


class FakeEngine:
    def __init__(self, events: list, fail_label: str | None = None, fail_reset: bool = False):
        self.events, self.fail_label, self.fail_reset = events, fail_label, fail_reset
        self.label = "base"

    async def update_weight_version(self, label: str) -> None:
        self.events.append(("label", label))
        if label == self.fail_label:
            raise RuntimeError(f"label {label} failed")
        self.label = label

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.events.append(("reset",))
        if self.fail_reset:
            raise RuntimeError("reset failed")
        return True

    async def pause_generation(self, **kw) -> None:
        self.events.append(("pause",))

    async def resume_generation(self) -> None:
        self.events.append(("resume",))


class Replica:
    """A RolloutEngine at v4 whose worker calls are scripted."""

    def __init__(self, tmp_path, *, fail_label=None, fail_reset=False, fail_rpc=(), audit_bad=()):
        self.events: list = []
        self.eng = RolloutEngine(Namespace(work_dir=str(tmp_path / "work"), predict=False))
        self.eng.engine = FakeEngine(self.events, fail_label, fail_reset)
        st = self.eng.state
        st.version, st.commitment, st.state_digest, st.status = 4, "c4", "d4", "ready"
        self.fail_rpc, self.audit_bad = set(fail_rpc), list(audit_bad)
        self.released: list[str] = []
        self.eng.rpc, self.eng.rpc_all = self.rpc, self.rpc_all
        self.eng.job, self.eng.job_all = self.job, self.job_all
        self.eng.chain = SimpleNamespace(manifest=lambda v: SimpleNamespace(version=v, commitment=f"c{v}",
                                                                             state_fingerprint=f"f{v}",
                                                                             state_digest=f"d{v}"))

    async def rpc(self, method: str, *args: str) -> dict:
        # what the replica says about itself at the moment of the call
        self.events.append((method, self.eng.state.status, self.eng.state.version))
        if method in self.fail_rpc:
            raise DeltaError("digest_mismatch", f"{method} failed")
        if method == "deltasync_release":
            self.released.append(args[0])
        if method == "deltasync_held":
            return {"version": 4, "commitment": "c4", "state_digest": "d4", "state_fingerprint": "f4"}
        return {"write_s": 0.0, "load_s": 0.0, "verify_s": 0.0}

    async def rpc_all(self, method: str, *args: str) -> list[dict]:  # one rank
        return [await self.rpc(method, *args)]

    async def job_all(self, kind: str, arg: str = "") -> list[dict]:
        return [await self.job(kind, arg)]

    async def job(self, kind: str, arg: str = "") -> dict:
        self.events.append((kind,))
        if kind == "stage":
            return {"stage_s": 0.0, "changed": 1, "stage": "S1"}
        if kind == "audit":
            return {"bad": self.audit_bad, "rolled": 0, "drifted": [], "audit_s": 0.0, "rolling_s": 0.0}
        return {}

    def delta(self, tmp_path):
        path = tmp_path / "d.safetensors"
        path.write_bytes(b"x")
        return self.eng._apply(None, "wait", local=(path, StepReport(version=5, kind="delta", base_version=4)))

    def anchor(self, tmp_path):
        path = tmp_path / "a.safetensors"
        path.write_bytes(b"x")
        self.eng._download = self._download(path)
        ref = SimpleNamespace(kind="anchor", key="anchors/v5", version=5, size=1, external=None)
        return self.eng._apply(ref, "wait")

    @staticmethod
    def _download(path):
        async def download(ref):
            return path, 0.0
        return download

    def resumed_while(self) -> tuple:
        """(status, label) when generation resumed."""
        i = self.events.index(("resume",))
        labels = [e[1] for e in self.events[:i] if e[0] == "label"]
        return self._status_at_resume, labels[-1] if labels else "base"


def run(coro):
    return asyncio.run(coro)


def _watch_resume(r: Replica) -> None:
    """Record the status at the moment generation resumes."""
    engine = r.eng.engine
    orig = engine.resume_generation

    async def resume():
        r._status_at_resume = (r.eng.state.status, r.eng.state.version)
        await orig()

    engine.resume_generation = resume


@pytest.mark.parametrize("fault", ["label", "reset"])
def test_worker_and_engine_never_disagree_when_the_label_or_cache_reset_fails(tmp_path, fault):
    r = Replica(tmp_path, fail_label="5" if fault == "label" else None, fail_reset=fault == "reset")
    _watch_resume(r)
    with pytest.raises(RuntimeError):
        run(r.delta(tmp_path))
    s = r.eng.state
    # the worker holds v5 now: claiming v4 would refuse every later delta; so: openly damaged
    assert s.status == "damaged" and s.version != 4
    (status, _), label = r.resumed_while()
    assert status == "damaged", "generation resumed before the replica said it is damaged"
    assert r.released == ["S1"]


def test_a_failed_dense_load_is_damaged_before_generation_resumes(tmp_path):
    r = Replica(tmp_path, fail_rpc={"deltasync_load"})
    _watch_resume(r)
    with pytest.raises(DeltaError):
        run(r.anchor(tmp_path))
    assert r.eng.state.status == "damaged" and r.eng.state.version is None
    (status, version), label = r.resumed_while()
    assert (status, version, label) == ("damaged", None, "damaged")


def test_a_failed_write_or_audit_still_releases_the_stage(tmp_path):
    r = Replica(tmp_path, fail_rpc={"deltasync_write"})
    with pytest.raises(DeltaError):
        run(r.delta(tmp_path))
    assert r.released == ["S1"]
    assert (r.eng.state.version, r.eng.state.status) == (4, "ready")

    r = Replica(tmp_path, audit_bad=["w"])
    with pytest.raises(DeltaError, match="read back wrong"):
        run(r.delta(tmp_path))
    assert r.released == ["S1"]
    assert r.eng.state.version == 4  # reverted: deltasync_held says v4


def test_a_successful_delta_moves_state_label_and_release_together(tmp_path):
    r = Replica(tmp_path)
    _watch_resume(r)
    run(r.delta(tmp_path))
    s = r.eng.state
    assert (s.version, s.commitment, s.state_digest, s.state_fingerprint) == (5, "c5", "d5", "f5")
    (status, version), label = r.resumed_while()
    assert version == 5 and label == "5"
    assert r.released == ["S1"]


def test_a_damaged_label_is_no_version_not_a_server_error():
    assert version_of("damaged") is None
    assert policy_fields({0: [("damaged", 0, 3)]}, "4") == {"policy_version": None}
