"""Version chains in a store: publish protocol, planning, anchors, retention, concurrency."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shared.chain import AnchorPolicy, Chain, ObjectRef, delta_key, reconstruct
from shared.codec import DeltaFile
from shared.digest import state_digest
from shared.errors import DeltaError
from shared.publisher import DeltaPublisher
from shared.squash import squash
from shared.stores import Store, open_store

from .helpers import adamw_steps, perturb, same_bits

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def drifting(n_versions: int, fraction=0.01, seed=0):
    torch.manual_seed(seed)
    state = {"a.weight": (torch.randn(128, 64) * 0.02).bfloat16(), "b.bias": torch.zeros(64)}
    yield state
    for i in range(n_versions):
        new = perturb(state, fraction, seed + i + 1)
        for n in state:
            state[n].copy_(new[n])
        yield state


def publish_chain(store, n, policy=None, keep_anchors=100, digests="every"):
    states = []
    gen = drifting(n)
    live = next(gen)
    states.append({k: v.clone() for k, v in live.items()})
    with DeltaPublisher(live, store, policy=policy or AnchorPolicy(max_deltas=4),
                        keep_anchors=keep_anchors, dtype=None, digests=digests) as pub:
        for _ in gen:
            pub.publish()
            states.append({k: v.clone() for k, v in live.items()})
    return states, pub


def test_every_version_rebuilds_exactly(tmp_path):
    states, pub = publish_chain(str(tmp_path), 10)
    chain = Chain(open_store(tmp_path))
    assert chain.latest().version == 10
    assert chain.versions() == list(range(11))
    for v in range(11):
        state, header = reconstruct(chain, v)
        assert same_bits(state, states[v])
        assert header.state_digest == state_digest(states[v]) == chain.manifest(v).state_digest
    assert [r.kind for r in pub.reports][:6] == ["anchor", "delta", "delta", "delta", "delta+anchor", "delta"]


def test_the_encoder_says_where_its_time_went(tmp_path):
    """Each delta's ``encoder_parts`` splits its ``encoder_s``: its parts are all there, none
    negative, together no more than the whole, and an anchor's share only where one was written;
    the genesis anchor is not the encoder's."""
    _, pub = publish_chain(str(tmp_path), 5)
    first, *deltas = pub.reports
    assert first.kind == "anchor" and first.encoder_parts == {}
    for r in deltas:
        parts = r.encoder_parts
        assert set(parts) == {"resolve_s", "code_s", "header_s", "file_s", "anchor_s"}, r.version
        assert all(v >= 0 for v in parts.values()) and 0 < sum(parts.values()) <= r.encoder_s, (r.version, parts)
        assert (parts["anchor_s"] > 0) == (r.kind == "delta+anchor"), (r.version, r.kind, parts)
    assert [r.kind for r in deltas] == ["delta", "delta", "delta", "delta+anchor", "delta"]


def test_digests_only_at_anchors(tmp_path, monkeypatch):
    """``digests="anchors"``: a delta names fingerprints alone and the publisher hashes no tensor
    whole for it; an anchor hashes the tensors touched since they were last hashed. Every version
    still rebuilds bit for bit, is verified (by fingerprint) and squashes."""
    import shared.codec
    import shared.publisher
    from shared.fingerprint import state_fingerprint_of

    hashed: list[int] = []  # elements hashed whole with blake3, per publish()
    for module in (shared.codec, shared.publisher):
        real = module.tensor_digest
        monkeypatch.setattr(module, "tensor_digest", lambda t, real=real: hashed.append(t.numel()) or real(t))
    states, pub = publish_chain(str(tmp_path), 6, digests="anchors")
    chain = Chain(open_store(tmp_path))
    kinds = [r.kind for r in pub.reports]
    assert kinds == ["anchor", "delta", "delta", "delta", "delta+anchor", "delta", "delta"]
    numel = sum(t.numel() for t in states[0].values())
    # v0 hashes the model once; v4's anchor hashes "a.weight" (touched since), and nothing else does
    a, b = states[0]["a.weight"].numel(), states[0]["b.bias"].numel()
    assert sorted(hashed) == [b, a, a]
    assert sum(hashed) < 2 * numel
    for v, s in enumerate(states):
        m = chain.manifest(v)
        assert m.state_fingerprint == state_fingerprint_of(s)
        assert m.state_digest == (state_digest(s) if kinds[v] != "delta" else "")
        state, header = reconstruct(chain, v)
        assert same_bits(state, s) and header.state_fingerprint == m.state_fingerprint
    delta = chain.fetch(chain.manifest(3).object("delta"))
    assert delta.header.state_digest == "" and all(e.digest == "" for e in delta.header.tensors.values())
    joined = DeltaFile.from_bytes(squash([chain.fetch(chain.manifest(v).object("delta")) for v in (5, 6)]))
    target = {n: t.clone() for n, t in states[4].items()}
    from shared.apply import apply_delta

    apply_delta(joined, target, version=4, commitment=chain.manifest(4).commitment)
    assert same_bits(target, states[6]) and joined.header.commitment == chain.manifest(6).commitment
    wrong = {n: t.clone() for n, t in states[4].items()}
    unchanged = sorted(set(range(8)) - set(joined.change("a.weight").positions.tolist()))[0]
    wrong["a.weight"].view(-1)[unchanged] += 1  # not the base: found by the fingerprint after the write
    with pytest.raises(DeltaError) as e:
        apply_delta(joined, wrong, version=4, commitment=chain.manifest(4).commitment)
    assert e.value.reason == "digest_mismatch"


def test_plan_is_cheapest(tmp_path):
    publish_chain(str(tmp_path), 9)
    chain = Chain(open_store(tmp_path))
    # from v5 to v9: deltas only (an anchor costs far more)
    plan = chain.plan(5, 9, chain.manifest(5).commitment)
    assert [(o.kind, o.version) for o in plan] == [("delta", 6), ("delta", 7), ("delta", 8), ("delta", 9)]
    # from nothing: newest anchor at or before the target, then deltas
    assert [(o.kind, o.version) for o in chain.plan(None, 9)] == [("anchor", 8), ("delta", 9)]
    # a replica whose commitment disagrees with the chain must restart from an anchor
    assert chain.plan(5, 9, "f" * 64)[0].kind == "anchor"
    # a squashed delta 5->9 that is smaller than the sum replaces the four
    files = [chain.fetch(o) for o in plan]
    data = squash(files)
    ref = ObjectRef(kind="delta", version=9, base_version=5, key=delta_key(5, 9), size=len(data),
                    blake3=__import__("blake3").blake3(data).hexdigest())
    chain.add_object(9, ref.key, data, ref)
    assert sum(o.size for o in plan) > len(data)
    assert [(o.base_version, o.version) for o in Chain(open_store(tmp_path)).plan(5, 9)] == [(5, 9)]


def test_retention_keeps_what_replicas_need(tmp_path):
    states, _ = publish_chain(str(tmp_path), 14, keep_anchors=2)
    chain = Chain(open_store(tmp_path))
    versions = chain.versions()
    anchors = [v for v in versions if chain.manifest(v).object("anchor")]
    assert anchors == [8, 12] and versions[0] == 8
    for v in versions:
        assert same_bits(reconstruct(chain, v)[0], states[v])
    assert not any(k.endswith(f"v{v:08d}.safetensors") for v in range(8) for k in
                   open_store(tmp_path).list("deltas") + open_store(tmp_path).list("anchors"))


def test_missing_and_corrupt_objects(tmp_path):
    publish_chain(str(tmp_path), 3)
    store = open_store(tmp_path)
    chain = Chain(store)
    raw = store.get(delta_key(1, 2))
    store.put(delta_key(1, 2), raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(DeltaError) as e:
        chain.fetch(chain.manifest(2).object("delta"))
    assert e.value.reason == "corrupt"
    store.delete(delta_key(2, 3))
    with pytest.raises(DeltaError) as e:
        chain.fetch(chain.manifest(3).object("delta"))
    assert e.value.reason == "missing"


def test_reader_never_sees_a_partial_version(tmp_path):
    """A writer process publishes while this process reads: every latest is complete.

    Writer and reader take turns by lines on a pipe, not by timing: after queueing version v the
    writer waits for the reader, whose reads race the upload of v (and, after it lets the writer
    go on, the encoding and upload of v+1). So every run reads twice per version, whatever the
    machine's speed, and the versions it sees advance with the writer."""
    import threading

    store_dir = tmp_path / "store"
    n = 40
    writer = subprocess.Popen([sys.executable, str(ROOT / "tests/library/chain_writer.py"),
                               str(store_dir), str(n), "--gated"], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    guard = threading.Timer(300, writer.kill)  # a hung writer ends the pipe, never the test run
    guard.start()
    chain = Chain(open_store(store_dir))
    seen: list[int] = []

    def read() -> None:
        latest = chain.latest()
        if latest is not None:
            m = chain.manifest(latest.version)
            assert m.commitment == latest.commitment
            for ref in m.objects:
                f = chain.fetch(ref)  # size + blake3 + header checks
                assert f.header.version == latest.version and f.header.commitment == m.commitment
            seen.append(latest.version)

    try:
        for v in range(1, n + 1):
            assert writer.stdout.readline() == f"published {v}\n"
            read()  # races the upload of v
            writer.stdin.write("go\n")
            writer.stdin.flush()
            read()  # races the encoding and upload of v+1
        writer.stdin.close()
        assert writer.wait(timeout=120) == 0
    finally:
        guard.cancel()
        writer.kill()
    assert seen == sorted(seen) and len(seen) >= n  # latest never moves back; v0 lands first
    # reads follow the writer: when publish(v) returns, v-1 may wait in the encoder to be queued,
    # v-2 and v-3 in the upload queue (queue_size 2) and v-4 be uploading, so latest >= v-5
    assert len(set(seen)) > 2 and seen[-1] >= n - 5
    assert chain.latest().version == n
    assert reconstruct(Chain(open_store(store_dir)), n)[1].version == n


class FlakyStore(Store):
    """A store whose uploads for some versions fail (as a network outage would)."""

    def __init__(self, inner: Store, fail: set[str], times: int):
        super().__init__(inner.fs, inner.root, inner.uri)
        self.fail, self.times = fail, times

    def put(self, key, data):
        if any(f in key for f in self.fail) and self.times > 0:
            self.times -= 1
            raise ConnectionError(f"simulated outage uploading {key}")
        super().put(key, data)


def test_failed_uploads_are_retried_and_never_break_the_chain(tmp_path):
    gen = drifting(6)
    live = next(gen)
    store = FlakyStore(open_store(tmp_path), {"v00000002"}, times=2)  # two failures: retried
    pub = DeltaPublisher(live, store, retries=3, backoff_s=0, dtype=None)
    next(gen)
    pub.publish()
    next(gen)
    pub.publish()
    pub.flush()
    assert [r.kind for r in pub.reports] == ["anchor", "delta", "delta"]
    store.fail, store.times = {"v00000003"}, 100  # fails for good
    next(gen)
    pub.publish()
    pub.flush()
    assert pub.reports[-1].kind == "failed" and pub.errors
    store.times = 0
    next(gen)
    r = pub.publish()  # the chain heals with an anchor (alone: its delta's base never landed)
    pub.close()
    assert r.kind == "anchor"
    chain = Chain(open_store(tmp_path))
    assert 3 not in chain.versions() and chain.latest().version == 4
    state, header = reconstruct(chain)
    assert same_bits(state, live) and header.state_digest == pub.state_digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_publisher_on_real_gradients(tiny_model_dir, tmp_path, dtype):
    """fp32 master weights compare after the bf16 cast; bf16 models compare directly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    pub = DeltaPublisher(model, str(tmp_path), policy=AnchorPolicy(catchup_fraction=100))
    digests = []
    for _ in adamw_steps(model, 4, lr=1e-5 if dtype == torch.float32 else 1e-3):
        pub.publish()
        digests.append(pub.state_digest)
    pub.close()
    chain = Chain(open_store(tmp_path))
    for v, d in enumerate(digests, start=1):
        assert reconstruct(chain, v)[1].state_digest == d
    from shared.checkpoint import module_state

    live = {n: t.to(torch.bfloat16) for n, t in module_state(model).items()}
    assert state_digest(live) == digests[-1]
    fractions = [r.changed_fraction for r in pub.reports[1:]]
    assert all(0 < f < 1 for f in fractions)


def test_delta_file_opens_in_safetensors(tmp_path):
    import safetensors

    publish_chain(str(tmp_path), 2)
    path = tmp_path / delta_key(1, 2)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "deltasync"
        assert any(k.endswith("::val") for k in f.keys())
    assert DeltaFile.open(path).header.version == 2
