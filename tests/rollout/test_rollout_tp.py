"""A tensor-parallel replica (``--tensor-parallel-size 2``, vLLM on CPU, one OMP thread per rank)
follows a trainer exactly: each rank stages and writes only its own shard, the ranks' partial
fingerprints must add up before any rank writes (and after each rank loads its shard of an
anchor), and ``/weights/digest`` puts every split tensor together from both ranks to hash it
with blake3.

One replica for the module; each test starts from whatever version it serves and publishes its
own versions on top.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chain_helpers import FakeTrainer
from conftest import Server, launch, wait_ready
from update_helpers import announced_step, live_digest, metric, next_states, perturb, refused, unannounced_steps

from shared.chain import AnchorPolicy
from shared.codec import DeltaFile, encode_delta

pytestmark = pytest.mark.slow
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank


@pytest.fixture(scope="module")
def store(rollout_dir: Path) -> Path:
    return rollout_dir / "bucket-tp"


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path, store: Path):
    t = FakeTrainer(tiny_model_dir, str(store), lr=2e-5, seed=3, token="test-token")
    t.publisher.flush()
    yield t
    t.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, store: Path, trainer, rollout_dir: Path):
    workdir = rollout_dir / "tp"
    workdir.mkdir(exist_ok=True)
    s = wait_ready(launch(tiny_model_dir, store, workdir, "--tensor-parallel-size", "2", env=TP_ENV))
    trainer.publisher.replicas.append(s.url)
    yield s
    s.stop()


def test_two_ranks_serve_the_checkpoint_and_every_version_exactly(server: Server, trainer: FakeTrainer):
    assert metric(server, "deltasync_engine_ranks") == 2
    assert metric(server, "deltasync_split_tensors") > 0  # e.g. the embedding, q, o, gate, up, down
    d = live_digest(server)
    assert d["state_digest"] == trainer.publisher.chain.manifest(server.get("/version").json()["version"]).state_digest
    for i in range(3):
        trainer.publisher.compact = i == 2  # positions coded against the base, too
        report = trainer.step()
        trainer.publisher.flush()
        answer = report.replicas[server.url]
        assert answer.get("version") == report.version and answer.get("state_digest") == report.state_digest, answer
        d = live_digest(server)  # blake3 of every tensor, the split ones put together from both ranks
        assert (d["version"], d["state_digest"], d["matches_held"]) == (report.version, report.state_digest, True)
        assert server.complete()["policy_version"] == report.version
    trainer.publisher.compact = False
    assert metric(server, "deltasync_rolling_audit_mismatches_total") == 0
    assert metric(server, "deltasync_rolling_audit_tensors_total") > 0


def test_two_ranks_catch_up_over_several_versions(server: Server, trainer: FakeTrainer):
    start = announced_step(server, trainer)
    reports = unannounced_steps(trainer, 3)
    r = server.update()
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == reports[-1].version == start + 3
    assert body["state_digest"] == reports[-1].state_digest
    assert [s["base_version"] for s in body["steps"]] == [start]  # three deltas squashed into one write
    d = live_digest(server)
    assert (d["version"], d["state_digest"]) == (reports[-1].version, reports[-1].state_digest)


def test_two_ranks_refuse_bad_deltas_and_keep_serving(server: Server, trainer: FakeTrainer, store: Path):
    announced_step(server, trainer)
    state, new, h = next_states(store)
    data = encode_delta(state, new, version=h.version + 1, base_version=h.version, base_commitment=h.commitment)
    damaged = bytearray(data)
    damaged[-3] ^= 0x40
    refused(server, store, bytes(damaged), DeltaFile.from_bytes(data).header, 422, "corrupt")
    # right commitment, wrong bits underneath positions in a tensor both ranks hold half of (the
    # rows of q_proj): neither rank alone can tell, the sum of their parts can, before any write
    other = {n: t.clone() for n, t in state.items()}
    q = "model.layers.0.self_attn.q_proj.weight"
    other[q].view(-1).view(torch.int16)[::97] ^= 1
    nxt = dict(other)
    nxt[q] = perturb({q: other[q]})[q]
    flips = other[q].view(-1).view(torch.int16)[::97]
    nxt[q].view(-1).view(torch.int16)[::97] = flips ^ 6  # every wrong position also changes
    data = encode_delta(other, nxt, version=h.version + 1, base_version=h.version, base_commitment=h.commitment)
    refused(server, store, data, DeltaFile.from_bytes(data).header, 422, "digest_mismatch")
    assert live_digest(server)["matches_held"]
    assert announced_step(server, trainer) == h.version + 1  # and the next good version lands


def test_two_ranks_load_an_anchor_whole(server: Server, trainer: FakeTrainer):
    """Two steps that change every element: the chain anchors, and catching up over both is
    cheaper through the newest anchor than through two model-sized deltas. Each rank loads its
    shard of the file; the ranks' parts must add up to the file's fingerprints."""
    start = announced_step(server, trainer)
    lr, trainer.lr = trainer.lr, 0.5
    try:
        reports = unannounced_steps(trainer, 2)
    finally:
        trainer.lr = lr
    r = server.update()
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(s["kind"], s["version"]) for s in body["steps"]] == [("anchor", start + 2)], body["steps"]
    assert (body["version"], body["state_digest"]) == (reports[-1].version, reports[-1].state_digest)
    d = live_digest(server)
    assert (d["version"], d["state_digest"], d["matches_held"]) == (start + 2, reports[-1].state_digest, True)
    assert announced_step(server, trainer) == start + 3  # a delta lands on top of the loaded anchor
    assert live_digest(server)["state_digest"] == trainer.publisher.state_digest


def test_two_ranks_follow_deltas_without_digests(server: Server, trainer: FakeTrainer):
    """Deltas published with ``digests="anchors"`` name no blake3 digest: both ranks check them by
    fingerprint, and the live digest, whose split tensors the server puts together from both
    ranks, is still the blake3 of the trainer's own state and matches by fingerprint."""
    from shared.digest import state_digest

    # no anchor at these steps, whatever the deltas before them added up to: an anchor names its digest
    policy, trainer.publisher.policy = trainer.publisher.policy, AnchorPolicy(catchup_fraction=1e9)
    trainer.publisher.digests = "anchors"
    try:
        for _ in range(2):
            report = trainer.step()
            trainer.publisher.flush()
            assert report.state_digest == ""
            answer = report.replicas[server.url]
            assert (answer.get("version"), answer.get("state_fingerprint")) == \
                (report.version, report.state_fingerprint), answer
            d = live_digest(server)
            want = state_digest({n: t.bfloat16() for n, t in trainer.master.items()})
            assert (d["version"], d["state_digest"], d["state_fingerprint"], d["matches_held"], d["mismatched"]) == \
                (report.version, want, report.state_fingerprint, True, [])
    finally:
        trainer.publisher.digests, trainer.publisher.policy = "every", policy
    report = trainer.step()  # back to digests every version: the unknown ones computed once
    trainer.publisher.flush()
    assert report.state_digest == state_digest({n: t.bfloat16() for n, t in trainer.master.items()})
    assert report.replicas[server.url].get("state_digest") == report.state_digest
