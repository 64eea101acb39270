"""The Space's entry point is closed by default."""

from __future__ import annotations

import os
import subprocess
import sys

from shared.process import REPO, free_port


def test_refuses_a_public_address_without_a_trainer_token():
    env = {k: v for k, v in os.environ.items() if k not in ("DELTASYNC_TRAINER_TOKEN", "DELTASYNC_TOKEN")}
    proc = subprocess.run([sys.executable, "-m", "trainer_space", "--host", "0.0.0.0", "--port", str(free_port())],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "refusing to serve on 0.0.0.0 without DELTASYNC_TOKEN or DELTASYNC_TRAINER_TOKEN" in proc.stderr
    assert "--insecure-no-token" in proc.stderr


# torch must not be loaded yet when trainer_space sets the spin, or libgomp never sees it
PROBE = ("import sys, os, trainer_space; "
         "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")


def _spin_settings(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_trainer_bounds_openmp_spin_before_torch_loads_and_keeps_a_users_choice():
    import torch  # noqa: F401 - loaded here, as in every trainer that imports it first

    from shared.openmp import SPINCOUNT, bound_openmp_spin

    assert _spin_settings() == f"{SPINCOUNT} None False"
    assert _spin_settings(GOMP_SPINCOUNT="5") == "5 None False"
    assert _spin_settings(OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE False"
    env: dict[str, str] = {}
    assert bound_openmp_spin(env) is False  # too late for this process's libgomp
    assert env == {"GOMP_SPINCOUNT": SPINCOUNT}


def test_the_publisher_settings_reach_the_publisher(monkeypatch, tmp_path):
    """DELTASYNC_COPY_FROM is read into the run's settings (checked there), and the transfer trl
    drives hands it to the publisher, which then copies every tensor from the second version on."""
    import pytest
    import torch
    from pydantic import ValidationError

    from shared.publisher import BUSY_FRACTION
    from trainer_space.__main__ import space_defaults
    from trainer_space.transfer import DeltaSyncTransfer

    monkeypatch.delenv("DELTASYNC_COPY_FROM", raising=False)
    assert space_defaults().copy_from == BUSY_FRACTION
    monkeypatch.setenv("DELTASYNC_COPY_FROM", "0")
    assert space_defaults().copy_from == 0.0
    monkeypatch.setenv("DELTASYNC_COPY_FROM", "2")
    with pytest.raises(ValidationError, match="copy_from"):
        space_defaults()

    weights = {"w": torch.randn(64, 32, generator=torch.Generator().manual_seed(0))}
    transfer = DeltaSyncTransfer(str(tmp_path / "store"), [], base="local-base", copy_from=0.0)
    try:
        for step in range(3):
            transfer.send_weights(iter(weights.items()))
            transfer.resume()
            weights["w"].add_(0.1 * (step + 1))
        assert transfer.publisher.copy_from == 0.0 and set(transfer.publisher._spare) == {"w"}
        reports = transfer.publisher.reports
        assert [r.version for r in reports] == [0, 1, 2, 3]  # the base, the cold sync, two steps
        assert [r.changed for r in reports[1:]] == [0, weights["w"].numel(), weights["w"].numel()]
    finally:
        transfer.destroy()
