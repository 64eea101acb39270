"""The rollout server with a real vLLM engine on CPU, driven over HTTP like the trainer drives it.

One replica follows a trainer for the whole module: digests at every step, generation during
updates, refusals, a fresh server on the target checkpoint and a late replica for comparison.
Each test starts from whatever version the replica serves and publishes its own versions on top;
what the replica served when it started is recorded before any test runs (:class:`Start`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from chain_helpers import FakeTrainer, checkpoint_dir
from conftest import TOKEN, Server, launch, wait_ready
from update_helpers import announced_step, live_digest, next_states, perturb, refused, unannounced_steps

from shared.codec import DeltaFile, encode_delta
from shared.digest import state_digest

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown", "Guess the five letter word:", "0 1 2 3"]


@dataclass(frozen=True)
class Start:
    """What the replica answered as it came up, before any test moved it."""

    version: dict  # GET /version
    digest: dict  # GET /weights/digest
    completion: dict  # greedy, PROMPTS[0]


@pytest.fixture(scope="module")
def store(rollout_dir: Path) -> Path:
    return rollout_dir / "bucket"


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path, store: Path):
    t = FakeTrainer(tiny_model_dir, str(store), lr=2e-5, token=TOKEN)
    t.publisher.flush()  # v0: the base model itself (external anchor, nothing uploaded)
    yield t
    t.close()


@pytest.fixture(scope="module")
def launched(tiny_model_dir: Path, store: Path, trainer, rollout_dir: Path):
    s = wait_ready(launch(tiny_model_dir, store, rollout_dir))
    try:
        start = Start(s.get("/version").json(), live_digest(s), s.complete(PROMPTS[0]))
        trainer.publisher.replicas.append(s.url)
        yield s, start
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server(launched) -> Server:
    return launched[0]


@pytest.fixture(scope="module")
def start(launched) -> Start:
    return launched[1]


def test_starts_on_the_base_model_as_version_0(start: Start, trainer: FakeTrainer):
    v0 = trainer.publisher.chain.manifest(0)
    assert start.version["version"] == 0 and start.version["status"] == "ready"
    assert start.version["commitment"] == v0.commitment
    assert start.digest["state_digest"] == v0.state_digest != "" and start.digest["matches_held"]
    assert start.completion["policy_version"] == 0


def test_live_digest_equals_trainer_at_every_step(server: Server, trainer: FakeTrainer):
    for i in range(3):
        # the last step is sparse (~1%) and codes positions against the base
        trainer.publisher.compact, lr = i == 2, trainer.lr
        trainer.lr = lr / 20 if i == 2 else lr
        report = trainer.step()
        trainer.lr = lr
        trainer.publisher.flush()
        answer = report.replicas[server.url]  # the replica's /update response
        assert answer.get("version") == report.version, answer
        assert answer.get("state_digest") == report.state_digest, answer
        if i == 2:
            ref = trainer.publisher.chain.manifest(report.version).object("delta")
            header = trainer.publisher.chain.fetch(ref).header
            assert any(e.positions == "classed" for e in header.tensors.values())
        assert 0 < report.changed < report.numel
        d = live_digest(server)
        assert d["version"] == report.version
        assert d["state_digest"] == report.state_digest  # computed from the engine's live weights
        assert d["commitment"] == report.commitment
        assert server.complete()["policy_version"] == report.version
    trainer.publisher.compact = False
    # every delta re-read 1/K of the tensors whole (K = 8 by default), and all matched
    m = {line.split()[0]: float(line.split()[1]) for line in server.get("/metrics").text.splitlines()
         if line.startswith("deltasync_") and " " in line}
    tensors = len(header.tensors) - 1  # the tied lm_head is not in the engine
    assert m["deltasync_audit_period_versions"] == 8
    assert m["deltasync_rolling_audit_tensors_total"] >= 3 * -(-tensors // 8)
    assert m["deltasync_rolling_audit_mismatches_total"] == 0


def test_real_openai_client(server: Server, trainer: FakeTrainer):
    from openai import OpenAI

    v = announced_step(server, trainer)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    c = client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                  logprobs=2, extra_body={"return_token_ids": True})
    assert c.model_extra["policy_version"] == v
    assert len(c.choices[0].logprobs.token_logprobs) == 6
    assert len(c.choices[0].model_extra["token_ids"]) == 6
    chat = client.chat.completions.create(model=server.model, max_tokens=5, temperature=0, logprobs=True,
                                          messages=[{"role": "user", "content": "crane"}])
    assert chat.model_extra["policy_version"] == v
    assert len(chat.choices[0].logprobs.content) == 5
    stream = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=4,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].model_extra["policy_version"] == v


def test_concurrent_requests_during_updates_carry_one_version_each(server: Server, trainer: FakeTrainer):
    start = announced_step(server, trainer)
    stop = threading.Event()
    results: list[tuple[int, dict]] = []
    lock = threading.Condition()

    def hammer(i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(server.url + "/v1/completions",
                           json={"model": server.model, "prompt": PROMPTS[i % len(PROMPTS)],
                                 "max_tokens": 16, "temperature": 1.0, "n": 1 + i % 2})
                with lock:
                    results.append((r.status_code, r.json()))
                    lock.notify_all()

    def answered(version: int, timeout: float = 120) -> None:
        """Wait until at least one response generated on ``version`` came back."""
        with lock:
            assert lock.wait_for(lambda: any(b.get("policy_version") == version for _, b in results),
                                 timeout), f"no response of v{version}"

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        answered(start)  # requests are running before the first update
        for _ in range(2):
            report = trainer.step()
            trainer.publisher.flush()
            answered(report.version)  # and after each one
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert results and all(code == 200 for code, _ in results), [b for c, b in results if c != 200][:2]
    versions = [body["policy_version"] for _, body in results]
    assert all(isinstance(v, int) for v in versions), [b for _, b in results if "policy_version_spans" in b][:1]
    assert set(versions) == {start, start + 1, start + 2}, versions
    assert live_digest(server)["state_digest"] == trainer.publisher.state_digest


def test_greedy_matches_fresh_server_and_late_replica_catches_up(
        server: Server, start: Start, trainer: FakeTrainer, tiny_model_dir: Path, store: Path, rollout_dir: Path):
    for _ in range(2):  # this test's own versions: the weights move away from the base
        target = announced_step(server, trainer)
    ckpt = checkpoint_dir(tiny_model_dir, str(store), target, rollout_dir / f"ckpt-v{target}")
    fresh = launch(ckpt, rollout_dir / "empty-bucket", rollout_dir)  # serves its own model
    late = launch(tiny_model_dir, store, rollout_dir)  # joins late: must catch up at start
    try:
        wait_ready(fresh), wait_ready(late)
        assert fresh.get("/version").json()["version"] is None
        assert late.get("/version").json()["version"] == target
        assert live_digest(late)["state_digest"] == live_digest(server)["state_digest"] \
            == live_digest(fresh)["state_digest"] == trainer.publisher.state_digest
        for p in PROMPTS:
            a, b = server.complete(p, 12), fresh.complete(p, 12)
            assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
            assert a["choices"][0]["logprobs"]["token_logprobs"] == b["choices"][0]["logprobs"]["token_logprobs"]
            assert late.complete(p, 12)["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]
        base = start.completion["choices"][0]["logprobs"]["token_logprobs"]
        assert server.complete(PROMPTS[0])["choices"][0]["logprobs"]["token_logprobs"] != base
    finally:
        fresh.stop(), late.stop()


def test_damaged_delta_is_refused_and_previous_version_served(server: Server, store: Path):
    state, new, h = next_states(store)
    data = encode_delta(state, new, version=h.version + 1, base_version=h.version,
                        base_commitment=h.commitment)
    header = DeltaFile.from_bytes(data).header
    damaged = bytearray(data)
    damaged[-3] ^= 0x40  # inside the last blob: its blake3 no longer matches the header
    refused(server, store, bytes(damaged), header, 422, "corrupt")


def test_wrong_base_delta_isrefused(server: Server, store: Path):
    state, new, h = next_states(store)
    other = {n: t.clone() for n, t in state.items()}
    other["model.norm.weight"].view(torch.int16)[0] ^= 1
    data = encode_delta(other, new, version=h.version + 1, base_version=h.version,
                        base_commitment=h.commitment[::-1])  # built on some other chain
    refused(server, store, data, DeltaFile.from_bytes(data).header, 409, "wrong_base")


def test_delta_that_would_not_reach_its_digest_is_refused_before_writing(server: Server, store: Path):
    state, _, h = next_states(store)
    other = {n: t.clone() for n, t in state.items()}  # right commitment, wrong base bits
    other["model.layers.0.mlp.down_proj.weight"].view(-1).view(torch.int16)[:50] ^= 3
    new = perturb(other)  # most of the 50 stay as in `other`, which this replica does not hold
    data = encode_delta(other, new, version=h.version + 1, base_version=h.version,
                        base_commitment=h.commitment)
    refused(server, store, data, DeltaFile.from_bytes(data).header, 422, "digest_mismatch")


def test_unauthorized_update_is_401(server: Server):
    assert server.post("/update", json={}).status_code == 401
    assert server.post("/update", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert server.post("/pause").status_code == 401


def test_pause_resume_and_update_without_waiting(server: Server, trainer: FakeTrainer):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert server.post("/pause", headers=auth).json() == {"status": "paused"}
    assert server.get("/is_paused").json() == {"is_paused": True}
    assert server.post("/resume", headers=auth).json() == {"status": "resumed"}
    assert server.get("/is_paused").json() == {"is_paused": False}
    (report,) = unannounced_steps(trainer)  # told below
    r = server.post("/update?wait=false", json={"version": report.version}, headers=auth)
    assert r.status_code == 202
    # one update at a time: this waits for the one started above, then has nothing to do
    r = server.update(report.version)
    assert r.status_code == 200 and r.json()["version"] == report.version, r.text
    assert server.get("/version").json()["version"] == report.version
    assert live_digest(server)["state_digest"] == report.state_digest == state_digest(
        {n: t.to(torch.bfloat16) for n, t in trainer.master.items()})
    assert server.get("/health").json() == {"status": "ok", "version": report.version}


def test_in_flight_update_when_asked_spans_two_versions(server: Server, trainer: FakeTrainer):
    """mode=keep: a request in flight continues on the new weights and says so, token by token."""
    before = server.get("/version").json()["version"]
    (report,) = unannounced_steps(trainer)  # told below
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(timeout=120) as c, c.stream(
            "POST", server.url + "/v1/completions",
            json={"model": server.model, "prompt": "The quick brown", "max_tokens": 400, "ignore_eos": True,
                  "temperature": 0, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))  # the request is running
        # freeze it where it is (keep), so the update certainly lands in its middle
        assert c.post(server.url + "/pause?mode=keep&clear_cache=false", headers=auth).status_code == 200
        try:
            r = c.post(server.url + "/update", json={"version": report.version, "mode": "keep"}, headers=auth)
        finally:
            assert c.post(server.url + "/resume", headers=auth).status_code == 200
        chunks = [first] + [line for line in lines if line.startswith("data: {")]
    assert r.status_code == 200 and r.json()["version"] == report.version, r.text
    body = next(p for p in (json.loads(c[len("data: "):]) for c in reversed(chunks)) if "policy_version" in p)
    assert body["policy_version"] is None and body["policy_versions"] == [before, report.version]
    spans = body["policy_version_spans"][0]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 400
    assert server.complete()["policy_version"] == report.version


def test_catch_up_over_several_versions_pauses_once(server: Server, trainer: FakeTrainer):
    """Deltas the replica missed are squashed and applied in one pause."""
    held = server.get("/version").json()["version"]
    reports = unannounced_steps(trainer, 3)
    r = server.update()
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == reports[-1].version and body["state_digest"] == reports[-1].state_digest
    assert [(s["base_version"], s["version"]) for s in body["steps"]] == [(held, reports[-1].version)]
    assert live_digest(server)["state_digest"] == trainer.publisher.state_digest
