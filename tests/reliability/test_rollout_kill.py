"""The rollout killed mid-update (issue 9): SIGKILL of the server and its engine core while it
stages a delta, inside the paused write, and during the audit after it. Nothing the replica holds
survives a kill, so what must hold is that nothing is lost on the store's side and a fresh server
on the same store and work folder comes up on an exact version, catches up, and serves.

Each point is reached by :mod:`reliability.fault_worker`, which writes a marker file and blocks
there; the test waits for the marker, then kills.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rollout.chain_helpers import FakeTrainer

from reliability.fault_worker import HOLD_ENV, HOLD_FILE_ENV, POINTS, QUALNAME
from reliability.servers import Server, kill_tree, launch, wait_ready
from shared.chain import Chain
from shared.stores import open_store

pytestmark = pytest.mark.slow
HOLD_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def map_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("maps")


class Trainer:
    """A :class:`FakeTrainer` that remembers each version's state digest, as the trainer knows it."""

    def __init__(self, model_dir: Path, store: Path):
        self.fake = FakeTrainer(model_dir, str(store), lr=2e-5)
        self.fake.publisher.flush()  # v0: the base model (external anchor)
        self.digests = {0: self.fake.publisher.state_digest}

    def step(self) -> int:
        """Publish one version, with no replica told; returns it once it landed."""
        report = self.fake.step().wait(120)
        self.digests[report.version] = report.state_digest
        return report.version

    @property
    def version(self) -> int:
        return self.fake.publisher.version


def wait_for_marker(marker: Path, server: Server) -> dict:
    """The fault worker reached its point (it writes the marker, then blocks)."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not marker.exists():
        assert server.proc.poll() is None, f"server exited before the hold:\n{server.log()[-4000:]}"
        assert time.monotonic() < deadline, f"no hold after {HOLD_TIMEOUT_S:.0f}s:\n{server.log()[-4000:]}"
        time.sleep(0.05)
    return json.loads(marker.read_text())


def assert_exact(server: Server, trainer: Trainer, version: int | None = None) -> int:
    """The server serves a version the trainer published, and its live weights are that version's."""
    v = server.version()
    assert v["status"] == "ready", v
    if version is not None:
        assert v["version"] == version, v
    assert v["version"] in trainer.digests, v
    d = server.live_digest()
    assert (d["version"], d["state_digest"]) == (v["version"], trainer.digests[v["version"]]), (v, d)
    assert d["matches_held"], d
    assert server.complete()["policy_version"] == v["version"]
    return v["version"]


# make test kills inside the paused write (the hardest point); make reliability kills at all three
@pytest.mark.parametrize("point", [p if p == "write" else pytest.param(p, marks=pytest.mark.long) for p in POINTS])
def test_sigkill_mid_update_then_restart_is_exact(point: str, tiny_model_dir: Path, tmp_path: Path,
                                                 map_cache: Path, tally):
    store, workdir = tmp_path / "bucket", tmp_path / "replica"
    trainer = Trainer(tiny_model_dir, store)
    survived, servers = False, []
    try:
        marker = tmp_path / "hold.json"
        held = launch(tiny_model_dir, store, workdir, "--worker-extension-cls", QUALNAME, map_cache=map_cache,
                      env={HOLD_ENV: point, HOLD_FILE_ENV: str(marker)})
        servers.append(held)
        wait_ready(held)
        assert_exact(held, trainer, 0)  # started on the base model: no stage, no hold yet

        target = trainer.step()
        r = held.update(target, params={"wait": "false"})
        assert r.status_code == 202, r.text
        hold = wait_for_marker(marker, held)
        assert hold["point"] == point
        killed = kill_tree(held)
        assert hold["pid"] in killed, (hold, killed)  # the engine core went down with the server

        trainer.step()  # training goes on while the replica is down
        chain = Chain(open_store(str(store)))  # nothing lost: every version is still there
        assert (chain.latest().version, chain.versions()) == (trainer.version, list(range(trainer.version + 1)))

        fresh = launch(tiny_model_dir, store, workdir, map_cache=map_cache, port=held.port)
        servers.append(fresh)
        wait_ready(fresh)
        assert_exact(fresh, trainer)  # whatever it came up on, it is exact (at start it catches up)
        left = [f.name for f in (workdir / "objects").glob("*.safetensors")
                if int(f.stem.rpartition("-")[2]) in killed]
        assert not left, f"downloads of the killed replica left behind: {left}"

        latest = trainer.step()
        r = fresh.update(latest)
        assert r.status_code == 200, r.text
        assert (r.json()["version"], r.json()["state_digest"]) == (latest, trainer.digests[latest]), r.json()
        assert_exact(fresh, trainer, latest)
        survived = True
    finally:
        tally.fault(f"rollout SIGKILL during {point}", survived=survived)
        for s in servers:
            s.stop()
        trainer.fake.close()
