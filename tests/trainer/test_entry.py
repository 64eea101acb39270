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
