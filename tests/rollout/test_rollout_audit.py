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
from conftest import launch, wait_ready
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
