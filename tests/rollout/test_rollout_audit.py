"""The audits against a real rollout server (vLLM on CPU, tiny Qwen3).

A test-only worker extension (``stray_worker.StrayWriteExtension``) flips one bit of a tensor no
delta touches, right after the first delta is written. The read-back audit of each delta's own
positions cannot see it; the rolling audit (``--audit-every 2``: every tensor re-read whole every
2 versions) must, within 2 versions: the replica then says it is damaged (503, the reason in
``/version`` and ``/metrics``), and the next update re-syncs it from an anchor, exact again.
Another (``RebindExtension``) swaps a written parameter for a new object: the read-back audit's
check that the parameters are still the model's must refuse the delta and revert it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TOKEN, launch, wait_ready
from stray_worker import REBIND_ENV, TENSOR_ENV
from update_helpers import metric

from shared.chain import AnchorPolicy
from shared.checkpoint import load_state
from shared.publisher import DeltaPublisher

pytestmark = pytest.mark.slow
STRAY = "model.norm.weight"  # the deltas below never change it
TRAINED = "model.layers.0.mlp.down_proj.weight"


def train_step(state: dict[str, torch.Tensor], g: torch.Generator, pub: DeltaPublisher):
    """A step that changes TRAINED only, published and uploaded: its report."""
    with torch.no_grad():
        state[TRAINED].add_(torch.randn(state[TRAINED].shape, generator=g).sign_() * 2e-3)
    report = pub.publish()
    pub.flush()
    return report


def test_rolling_audit_finds_a_stray_write_and_an_anchor_heals_it(tiny_model_dir: Path, tmp_path: Path):
    state = {n: t.float() for n, t in load_state(tiny_model_dir).items()}
    g = torch.Generator().manual_seed(0)
    with DeltaPublisher(state, str(tmp_path / "bucket"), external_base=str(tiny_model_dir),
                        policy=AnchorPolicy(max_deltas=3)) as pub:
        pub.flush()
        s = wait_ready(launch(tiny_model_dir, tmp_path / "bucket", tmp_path, "--audit-every", "2",
                              worker="stray_worker.StrayWriteExtension", env={TENSOR_ENV: STRAY}))
        try:
            assert metric(s, "deltasync_audit_period_versions") == 2
            answers = []
            for _ in range(3):  # v1 lands, then the stray write; the audits of v1 and v2 cover every tensor
                report = train_step(state, g, pub)
                answers.append(s.update(report.version))
                if answers[-1].status_code != 200:
                    break
            refused = answers[-1]
            assert len(answers) <= 3 and refused.status_code == 422, [a.text for a in answers]
            why = refused.json()["refused"]
            assert why["reason"] == "digest_mismatch" and "rolling audit" in why["message"] and STRAY in why["message"]
            version = s.get("/version").json()
            assert version["status"] == "damaged" and "rolling audit" in version["damage"]
            assert s.post("/v1/completions", json={"model": s.model, "prompt": "hi", "max_tokens": 2}).status_code == 503
            assert metric(s, "deltasync_rolling_audit_mismatches_total") == 1
            # the next version anchors (max_deltas=3 or the replica's re-sync plan): exact again
            report = train_step(state, g, pub)
            healed = s.update(report.version)
            assert healed.status_code == 200, healed.text
            assert healed.json()["state_digest"] == report.state_digest
            live = s.get("/weights/digest").json()
            assert live["state_digest"] == pub.state_digest and live["version"] == report.version
            assert s.get("/version").json()["status"] == "ready"
        finally:
            s.stop()


def test_a_parameter_swapped_for_a_new_object_is_refused_and_reverted(tiny_model_dir: Path, tmp_path: Path):
    state = {n: t.float() for n, t in load_state(tiny_model_dir).items()}
    g = torch.Generator().manual_seed(1)
    with DeltaPublisher(state, str(tmp_path / "bucket"), external_base=str(tiny_model_dir)) as pub:
        pub.flush()
        base_digest = pub.state_digest
        s = wait_ready(launch(tiny_model_dir, tmp_path / "bucket", tmp_path,
                              worker="stray_worker.RebindExtension", env={REBIND_ENV: TRAINED}))
        try:
            served = s.get("/version").json()["version"]
            report = train_step(state, g, pub)
            refused = s.update(report.version)
            assert refused.status_code == 422, refused.text
            why = refused.json()["refused"]
            assert why["reason"] == "digest_mismatch" and "read back wrong" in why["message"], why
            assert TRAINED in why["message"] and "reverted" in why["message"]
            assert s.get("/version").json()["version"] == served
            live = s.get("/weights/digest").json()  # read through the map: the old object, reverted
            assert live["state_digest"] == base_digest and live["version"] == served
            assert 'deltasync_updates_refused_total{reason="digest_mismatch"} 1.0' in s.get("/metrics").text
        finally:
            s.stop()


def sparse_step(state: dict[str, torch.Tensor], g: torch.Generator, pub: DeltaPublisher):
    """A step that changes ~1% of TRAINED, never its element 0 (sparse: positions are listed), uploaded."""
    with torch.no_grad():
        w = state[TRAINED].view(-1)[1::97]
        w.add_(torch.randn(w.shape, generator=g).sign_() * 2e-3)
    report = pub.publish()
    pub.flush()
    return report


def served(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the publisher publishes of fp32 master weights: their bf16 cast."""
    return {n: t.bfloat16() for n, t in state.items()}


def test_a_chain_with_digests_only_at_anchors_is_followed_exactly(tiny_model_dir: Path, tmp_path: Path):
    """``digests="anchors"``: deltas name no blake3 digest, so the replica checks them by
    fingerprint; its live digest (blake3 of the engine's weights) must still equal the blake3 of
    the trainer's own state at every version, and the anchor's manifest names that digest."""
    from shared.digest import state_digest
    from shared.fingerprint import state_fingerprint_of

    state = {n: t.float() for n, t in load_state(tiny_model_dir).items()}
    g = torch.Generator().manual_seed(2)
    with DeltaPublisher(state, str(tmp_path / "bucket"), external_base=str(tiny_model_dir), digests="anchors",
                        policy=AnchorPolicy(max_deltas=3)) as pub:
        pub.flush()
        s = wait_ready(launch(tiny_model_dir, tmp_path / "bucket", tmp_path))
        try:
            for version in (1, 2, 3):
                report = train_step(state, g, pub)
                assert report.version == version and report.kind == ("delta+anchor" if version == 3 else "delta")
                m = pub.chain.manifest(version)
                want_digest, want_fp = state_digest(served(state)), state_fingerprint_of(served(state))
                assert m.state_fingerprint == report.state_fingerprint == want_fp
                assert m.state_digest == report.state_digest == (want_digest if version == 3 else "")
                answer = s.update(version)
                assert answer.status_code == 200, answer.text
                body = answer.json()
                assert (body["version"], body["state_fingerprint"], body["state_digest"]) == \
                    (version, want_fp, m.state_digest)
                live = s.get("/weights/digest", params={"fresh": "true"},
                             headers={"Authorization": f"Bearer {TOKEN}"}).json()
                assert (live["version"], live["state_digest"], live["state_fingerprint"]) == \
                    (version, want_digest, want_fp), live
                assert live["matches_held"] and live["mismatched"] == []
        finally:
            s.stop()


def test_a_stray_write_into_a_tensor_whose_digest_is_unknown_is_found_by_fingerprint(
        tiny_model_dir: Path, tmp_path: Path):
    """With deltas that carry no digests, a touched tensor's blake3 digest is unknown to the
    replica; a stray write into it (at a position the delta did not change, so the read-back
    audit cannot see it, and no rolling audit reaches it this soon) must still make the full
    audit (``GET /weights/digest``) say the live weights are not the held version, naming it."""
    state = {n: t.float() for n, t in load_state(tiny_model_dir).items()}
    g = torch.Generator().manual_seed(3)
    with DeltaPublisher(state, str(tmp_path / "bucket"), external_base=str(tiny_model_dir),
                        digests="anchors") as pub:
        pub.flush()
        s = wait_ready(launch(tiny_model_dir, tmp_path / "bucket", tmp_path, "--audit-every", "1000",
                              worker="stray_worker.StrayWriteExtension", env={TENSOR_ENV: TRAINED}))
        try:
            report = sparse_step(state, g, pub)
            assert report.state_digest == ""
            answer = s.update(report.version)
            assert answer.status_code == 200, answer.text  # element 0 was not written: nothing read back wrong
            live = s.get("/weights/digest").json()
            assert live["version"] == report.version and not live["matches_held"], live
            assert live["mismatched"] == [TRAINED]
            assert live["state_fingerprint"] != report.state_fingerprint
        finally:
            s.stop()
