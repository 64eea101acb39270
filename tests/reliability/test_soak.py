"""Soak (issue 9): a trainer publishes a long run of versions with adaptive anchors and retention
while late joiners start at random (seeded) points: library readers (``reconstruct``, then
``Chain.plan`` from what they hold) and real rollout replicas (vLLM on CPU) started midway and
told ``/update`` at intervals. Every version any of them reaches must equal the trainer's own
state digest for that version, computed here from the trainer's tensors, not taken from the chain.

Readers race the publisher's upload thread, whose retention deletes old versions after each
anchor: a reader whose planned path was deleted under it plans again (as a replica's next
``/update`` would); that is counted, and it must still arrive exactly.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tqdm.auto import tqdm

from shared.apply import apply_delta
from shared.chain import AnchorPolicy, Chain, reconstruct
from shared.checkpoint import load_state
from shared.digest import state_digest
from shared.errors import DeltaError
from shared.publisher import DeltaPublisher, PublishReport
from shared.stores import open_store

from .servers import STARTUP_TIMEOUT_S, Server, launch

CATCHUP_FRACTION = 0.3  # anchor once a late replica's catch-up passes 30% of an anchor's bytes
KEEP_ANCHORS = 2
REPLAN_TRIES = 4


class DriftingTrainer:
    """bf16 weights of the tiny model, about 1% of elements moved per step (a rate that itself
    drifts between ~0.25% and ~3%, with one step in ten eight times denser, so the adaptive policy
    anchors at irregular intervals); a
    moved element flips one of its two lowest mantissa bits, as an optimizer step at RL learning
    rates does after the cast to bf16."""

    def __init__(self, model_dir: Path, store: str, seed: int):
        self.state = {n: t.clone() for n, t in load_state(model_dir).items()}
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.expected = {0: state_digest(self.state)}
        self.publisher = DeltaPublisher(self.state, store, external_base=str(model_dir),
                                        policy=AnchorPolicy(catchup_fraction=CATCHUP_FRACTION),
                                        keep_anchors=KEEP_ANCHORS)

    def step(self) -> PublishReport:
        rate = 0.01 * 2 ** self.rng.uniform(-2, 1.5) * (8 if self.rng.random() < 0.1 else 1)
        for t in self.state.values():
            bits = t.view(-1).view(torch.int16)
            moved = torch.rand(bits.shape, generator=self.gen) < rate
            bits[moved] ^= torch.randint(1, 4, (int(moved.sum()),), generator=self.gen, dtype=torch.int16)
        report = self.publisher.publish()
        self.expected[report.version] = state_digest(self.state)
        assert report.state_digest == self.expected[report.version]
        return report

    def landed(self) -> int:
        """The newest version, once its upload (and retention after it) finished."""
        self.publisher.flush(300)
        return self.publisher.chain.latest().version


class Reader:
    """A library reader that joins late and then follows: the first time it rebuilds the latest
    version from nothing, later it applies the cheapest path from the version it holds."""

    def __init__(self, store: str):
        self.chain = Chain(open_store(store, create=False))
        self.state: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.commitment = ""
        self.replans = self.rebuilds = self.deltas = 0

    def catch_up(self) -> int:
        for attempt in range(REPLAN_TRIES):
            try:
                target = self.chain.latest().version
                self._follow(target)
                return target
            except DeltaError as e:
                if e.reason != "missing" or attempt == REPLAN_TRIES - 1:
                    raise
                self.replans += 1  # retention deleted a manifest or object on the planned path
                self.chain.forget()
        raise AssertionError("unreachable")

    def _follow(self, target: int) -> None:
        if self.version == target:
            return
        plan = self.chain.plan(self.version, target, self.commitment or None) if self.version is not None else []
        if self.version is None or plan[0].kind == "anchor":
            self.state, header = reconstruct(self.chain, target)
            self.rebuilds += 1
            self.version, self.commitment = header.version, header.commitment
            return
        for ref in plan:
            header = apply_delta(self.chain.fetch(ref), self.state, version=self.version,
                                 commitment=self.commitment)
            self.version, self.commitment = header.version, header.commitment
            self.deltas += 1


def _check_replica_at(server: Server, version: int, expected: dict[int, str]) -> bool:
    """The replica serves ``version``: its held digest, the digest read back from the engine's
    live weights, and the version a completion names all agree with the trainer."""
    v = server.get("/version").json()
    live = server.live_digest()
    return (v["version"] == version and v["state_digest"] == expected[version]
            and live["version"] == version and live["state_digest"] == expected[version]
            and server.complete(max_tokens=2)["policy_version"] == version)


def soak(n: int, *, seed: int, readers: int, replicas: int, tally, model_dir: Path, workdir: Path,
         progress: bool = False) -> dict:
    """Publish ``n`` versions; readers and replicas join at seeded random versions and catch up at
    random intervals, racing the uploads (readers) or told after a flush (replicas, whose refusal
    would otherwise be a race with retention rather than a bug). Returns what the run did."""
    rng = random.Random(seed)
    store = str(workdir / "store")
    trainer = DriftingTrainer(model_dir, store, seed)
    join_readers = sorted(rng.sample(range(1, n), readers))
    join_replicas = sorted(rng.sample(range(n // 4, 3 * n // 4), replicas))
    followers: list[Reader] = []
    servers: list[tuple[Server, int]] = []  # a replica and the version it was last told
    try:
        trainer.publisher.flush(60)  # v0: the model's own checkpoint, named in the store
        for step in tqdm(range(1, n + 1), desc="soak", unit="version", disable=not progress):
            report = trainer.step()
            tally.fault("version published (adaptive anchors, retention)",
                        survived=report.state_digest == trainer.expected[step])
            for r in followers:
                if rng.random() < 0.3:
                    v = r.catch_up()
                    exact = state_digest(r.state) == trainer.expected[v]
                    tally.fault("library reader catches up (plan from held)", survived=exact)
                    assert exact, f"reader catching up to v{v}"
            if step in join_readers:
                followers.append(Reader(store))
                v = followers[-1].catch_up()
                exact = state_digest(followers[-1].state) == trainer.expected[v]
                tally.fault("late library reader joins at a random version", survived=exact)
                assert exact, f"reader joining at v{v}"
            if step in join_replicas:
                servers.append((_join_replica(trainer, model_dir, workdir, tally), step))
            for i, (server, told) in enumerate(servers):
                if step - told >= rng.randint(2, 8):
                    servers[i] = (server, _tell(server, trainer, tally))
        trainer.publisher.flush(300)
        for server, told in servers:
            _tell(server, trainer, tally)
        return _final_checks(trainer, store, followers, tally)
    finally:
        for server, _ in servers:
            server.stop()
        trainer.publisher.close()


def _join_replica(trainer: DriftingTrainer, model_dir: Path, workdir: Path, tally) -> Server:
    """Start a replica midway: it catches up to the store's latest version while it starts."""
    server = launch(model_dir, workdir / "store", workdir / "replicas")
    server.wait_ready(STARTUP_TIMEOUT_S)
    v = server.get("/version").json()["version"]
    exact = v is not None and _check_replica_at(server, v, trainer.expected)
    tally.fault("late rollout replica (vLLM) joins midway", survived=exact)
    assert exact, f"replica joined at v{v}: {server.get('/version').text}"
    return server


def _tell(server: Server, trainer: DriftingTrainer, tally) -> int:
    """POST /update to the newest landed version, as a trainer whose notifications were sparse."""
    target = trainer.landed()
    r = server.update(target)
    ok = r.status_code == 200 and r.json()["version"] == target \
        and r.json()["state_digest"] == trainer.expected[target] and _check_replica_at(server, target, trainer.expected)
    tally.request(ok=ok, case="replica told /update after several versions (exact)")
    assert ok, r.text
    return target


def _final_checks(trainer: DriftingTrainer, store: str, followers: list[Reader], tally) -> dict:
    """Every version retention kept rebuilds exactly; the policy anchored adaptively; retention
    deleted old versions; every reader reaches the last version."""
    reports = trainer.publisher.reports
    assert all(r.kind in ("delta", "delta+anchor", "anchor") for r in reports), [r.error for r in reports]
    anchors = [r.version for r in reports if "anchor" in r.kind and r.version > 0]
    assert len(anchors) >= 2, f"anchors at {anchors}"
    # adaptive: an anchor exactly when the delta bytes since the last one pass the catch-up budget
    budget, since = CATCHUP_FRACTION * reports[0].dense_bytes, 0
    for r in sorted((r for r in reports if r.version > 0), key=lambda r: r.version):
        since += r.payload_bytes
        assert ("anchor" in r.kind) == (since > budget), (r.version, r.kind, since, budget)
        since = 0 if "anchor" in r.kind else since
    dropped = sorted(v for r in reports for v in r.dropped)
    chain = Chain(open_store(store, create=False))
    kept = chain.versions()
    assert dropped and not set(dropped) & set(kept) and kept[-1] == trainer.publisher.version
    for v in kept:
        state, header = reconstruct(chain, v)
        exact = header.version == v and state_digest(state) == trainer.expected[v]
        tally.fault("version kept by retention rebuilds from the store", survived=exact)
        assert exact, v
    for r in followers:
        v = r.catch_up()
        exact = v == trainer.publisher.version and state_digest(r.state) == trainer.expected[v]
        tally.fault("library reader catches up (plan from held)", survived=exact)
        assert exact
    return {"anchors": anchors, "dropped": len(dropped), "replans": sum(r.replans for r in followers),
            "rebuilds": sum(r.rebuilds for r in followers), "deltas": sum(r.deltas for r in followers)}


@pytest.mark.slow
@pytest.mark.long
def test_soak_200_versions(tally, tiny_model_dir: Path, tmp_path: Path, capsys):
    with capsys.disabled():  # the progress bar reaches the terminal
        out = soak(200, seed=200, readers=8, replicas=2, tally=tally, model_dir=tiny_model_dir,
                   workdir=tmp_path, progress=True)
        print(f"\nsoak: anchors at {out['anchors']}; retention dropped {out['dropped']} versions; readers "
              f"applied {out['deltas']} deltas, rebuilt {out['rebuilds']} times, re-planned {out['replans']}")
    assert out["deltas"] > 0 and out["rebuilds"] >= 8, out
