"""The whole system in miniature: trl's AsyncGRPOTrainer, a vLLM rollout Space and the Wordle env
Space as three real processes; every version the replica serves is the trainer's, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STEPS

from shared.process import REPO

pytestmark = pytest.mark.slow


def test_local_run_is_exact_at_every_version(tmp_path: Path, policy_dir: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "model").symlink_to(policy_dir)  # reuse the built policy
    proc = subprocess.run([sys.executable, "-m", "trainer_space", "--local", "--max-steps", str(STEPS),
                           "--run-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "every version served bit-exactly" in proc.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report["exact"] is True
    versions = report["versions"]
    assert [v["version"] for v in versions] == list(range(1, STEPS + 2))  # the cold sync, then one per step
    (replica,) = report["replicas"]
    for v in versions:
        assert v["replica_state_digests"] == {replica: v["trainer_state_digest"]}
        assert 0 < v["payload_bytes"] < v["dense_bytes"]
    assert versions[0]["changed_fraction"] == 0.0  # the cold sync: the trainer holds the base checkpoint
    assert any(v["changed_fraction"] > 0 for v in versions[1:])  # training moved weights
    assert all(v["reward"] is not None for v in versions[1:])
    assert report["env"]["games_started"] > 0 and report["env"]["guesses"] > 0  # the policy played Wordle
    assert (run_dir / "report.png").stat().st_size > 10_000
