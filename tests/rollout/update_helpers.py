"""Steps, refusals and digests over HTTP, shared by the modules that drive a real replica."""

from __future__ import annotations

from pathlib import Path

import torch
from chain_helpers import FakeTrainer
from conftest import Server

from shared.chain import LATEST, Chain, Latest, delta_key, manifest_key, reconstruct, ref_for
from shared.stores import open_store


def live_digest(s: Server) -> dict:
    r = s.get("/weights/digest")
    assert r.status_code == 200, r.text
    return r.json()


def metric(s: Server, name: str) -> float:
    for line in s.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def announced_step(server: Server, trainer: FakeTrainer) -> int:
    """One trainer step that the replica was told about and serves: this test's own version."""
    report = trainer.step()
    trainer.publisher.flush()
    answer = report.replicas[server.url]
    assert answer.get("version") == report.version, answer
    return report.version


def unannounced_steps(trainer: FakeTrainer, n: int = 1) -> list:
    """Trainer steps published with no replica told (as if every notification were lost)."""
    saved, trainer.publisher.replicas[:] = list(trainer.publisher.replicas), []
    try:
        reports = [trainer.step() for _ in range(n)]
        trainer.publisher.flush()
    finally:
        trainer.publisher.replicas[:] = saved
    return reports


def publish_raw(store: Path, data: bytes, header) -> None:
    key = delta_key(header.base_version, header.version)
    Chain(open_store(str(store))).publish(header, {key: data}, [ref_for("delta", header, key, data)])


def unpublish(store: Path, version: int, back_to: Latest) -> None:
    s = open_store(str(store))
    s.delete(manifest_key(version))
    s.delete(delta_key(version - 1, version))
    s.put(LATEST, back_to.model_dump_json().encode())


def refused(server: Server, store: Path, data: bytes, header, status: int, reason: str) -> None:
    before = live_digest(server)
    latest = Chain(open_store(str(store))).latest()
    publish_raw(store, data, header)
    try:
        r = server.update()
        assert r.status_code == status, r.text
        body = r.json()
        assert body["refused"]["reason"] == reason and body["accepted"] is False
        assert body["version"] == before["version"]
        after = live_digest(server)
        assert after["state_digest"] == before["state_digest"] and after["version"] == before["version"]
        assert server.complete()["policy_version"] == before["version"]
        metrics = server.get("/metrics").text
        assert f'deltasync_updates_refused_total{{reason="{reason}"}}' in metrics
    finally:
        unpublish(store, header.version, latest)


def perturb(state: dict[str, torch.Tensor], seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {}
    for n, t in state.items():
        flip = torch.rand(t.shape, generator=g) < 0.05
        new[n] = torch.where(flip, (t.float() * 1.01 + 1e-3).to(t.dtype), t)
    return new


def next_states(store: Path):
    chain = Chain(open_store(str(store)))
    state, header = reconstruct(chain, chain.latest().version)
    return state, perturb(state), header
