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
