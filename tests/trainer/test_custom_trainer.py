"""The two ways to publish without trl: a plain PyTorch loop, and the raw protocol of the README."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from shared.checkpoint import load_state, save_state
from shared.digest import state_digest
from shared.process import REPO
from trainer_space.monitor import Monitor

pytestmark = pytest.mark.slow


def test_custom_trainer_example(services, policy_dir: Path):
    proc = subprocess.run([sys.executable, "examples/custom_trainer.py", "--model", str(policy_dir),
                           "--store", str(services.store), "--replica", services.rollout.url,
                           "--token", services.token, "--api-key", services.api_key, "--steps", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("v")]
    assert [ln.split(":")[0] for ln in lines] == ["v1", "v2", "v3"] and all(ln.endswith("exact") for ln in lines)
    assert httpx.get(f"{services.rollout.url}/version").json()["version"] == 3
    # The monitoring UI's attach mode sees this run from the outside: the store and the replica alone.
    monitor = Monitor(str(services.store), [services.rollout.url], services.env.url)
    monitor.refresh()
    rows = {r["version"]: r for r in monitor.rows()}
    assert sorted(rows) == [0, 1, 2, 3] and rows[3]["exact"] is True
    assert rows[3]["live"] == {services.rollout.url: rows[3]["state_digest"]}
    assert all(0 < rows[v]["payload_bytes"] < rows[v]["dense_bytes"] for v in (1, 2, 3))


def test_raw_protocol_push_then_post_update(services, policy_dir: Path, tmp_path: Path):
    """`deltasync push` two checkpoints, then `curl -X POST .../update`, as the README shows."""
    deltasync = [str(Path(sys.executable).parent / "deltasync")]
    base = load_state(policy_dir / "model.safetensors")
    save_state(base, tmp_path / "v0.safetensors")
    new = {n: t.clone() for n, t in base.items()}
    name = "model.layers.0.mlp.down_proj.weight"
    new[name].view(-1)[::97] = (new[name].view(-1)[::97].float() * 1.01).to(torch.bfloat16)
    save_state(new, tmp_path / "v1.safetensors")
    for ckpt in ("v0", "v1"):
        r = subprocess.run([*deltasync, "push", str(services.store), str(tmp_path / f"{ckpt}.safetensors")],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    curl = shutil.which("curl")
    assert curl, "curl is needed for the README's raw-protocol example"
    out = subprocess.run([curl, "-sS", "-X", "POST", f"{services.rollout.url}/update",
                          "-H", f"Authorization: Bearer {services.token}", "-H", "Content-Type: application/json",
                          "-d", '{"version": 1}'], capture_output=True, text=True, timeout=300)
    assert json.loads(out.stdout)["version"] == 1, out.stdout + out.stderr
    live = httpx.get(f"{services.rollout.url}/weights/digest", timeout=60).json()
    assert live["version"] == 1 and live["state_digest"] == state_digest(new)
    refused = subprocess.run([curl, "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                              f"{services.rollout.url}/update", "-d", "{}"], capture_output=True, text=True)
    assert refused.stdout == "401"  # no token, no update
