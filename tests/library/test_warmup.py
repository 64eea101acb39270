"""``shared.warmup.warm()`` compiles what a trainer's and a replica's first versions would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_warm_compiles_every_kernel_the_real_paths_call(tmp_path):
    """In a fresh process (a test worker has compiled kernels already), after warm() a trainer's
    versions (fp32 master weights published as bf16; bf16 weights with a tensor too big for a
    batched scan) and a replica's work on them (decode, gather, apply, fingerprint) compile no
    new kernel signature. A kernel or path added later and not warmed fails here."""
    out = subprocess.run([sys.executable, str(ROOT / "tests/library/warmup_probe.py")], cwd=ROOT,
                         env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["added"] == {}
    assert report["warmed"] >= 10
