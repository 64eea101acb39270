"""The first version after a process starts: what compiling numba's kernels costs it, and what
the warm-up (:mod:`shared.warmup`) leaves of that.

Each case runs in a fresh process with a numba cache folder of its own (``NUMBA_CACHE_DIR``) on
the locally built model and a change of 1% of its elements (``changed_state`` of
:mod:`bench.apply_vllm`): a :class:`~shared.publisher.DeltaPublisher` publishes it (the time
``publish()`` holds the training loop, then the encoder thread's), and a replica's in-process
apply of the delta follows (``apply_delta``: decode, check, write).

* **cold**: an empty cache, no warm-up (a Space container before the warm-up existed);
* **warmed**: an empty cache, ``warm()`` first (the Spaces at start-up on a CPU unlike the one
  their image was built on), its own time reported apart;
* **cached**: ``warm()`` on the cache the warmed case left (an image built on this kind of CPU).

Each case runs ``--reps`` times, each time in new processes and folders; medians.

    .venv/bin/python -m bench.cold_start [--hidden 512 --layers 8 ...] [--reps 3]

JSON: ``bench/results/cold_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("cold", "warmed", "cached")
STEPS = ("warm_s", "publish_s", "encoder_s", "apply_s")


def child(model_dir: Path, warm: bool) -> dict:
    """One process's first version (run as ``--child``)."""
    t0 = time.perf_counter()
    if warm:
        from shared.warmup import warm as warm_kernels

        warm_kernels()
    warm_s = time.perf_counter() - t0 if warm else 0.0

    from bench.apply_vllm import changed_state
    from shared.apply import apply_delta
    from shared.chain import AnchorPolicy, delta_key
    from shared.checkpoint import load_state
    from shared.codec import DeltaFile
    from shared.publisher import DeltaPublisher

    base = load_state(model_dir)
    new = changed_state(base, 0.01, seed=1)
    live = {n: t.clone() for n, t in base.items()}
    with tempfile.TemporaryDirectory(prefix="bench-cold-start-") as store:
        with DeltaPublisher(live, store, keep_anchors=10**6, policy=AnchorPolicy(catchup_fraction=1e9)) as pub:
            for n, t in new.items():
                live[n].copy_(t)
            t0 = time.perf_counter()
            report = pub.publish()
            publish_s = time.perf_counter() - t0
            report.wait(600)
        delta = DeltaFile.open(Path(store) / delta_key(0, 1))
        t0 = time.perf_counter()
        apply_delta(delta, base)
        apply_s = time.perf_counter() - t0
    return {"warm_s": warm_s, "publish_s": publish_s, "encoder_s": report.encoder_s, "apply_s": apply_s}


def run_child(model_dir: Path, cache: Path, warm: bool) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.cold_start", "--child", str(model_dir)]
                         + (["--warm"] if warm else []),
                         env={**os.environ, "NUMBA_CACHE_DIR": str(cache)}, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from bench.common import add_model_args, write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.warm)))
        return

    from rich.console import Console
    from rich.table import Table
    from tqdm.auto import tqdm

    from shared.tiny_model import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-cold-start-"))
    model_dir = build_tiny_model(tmp / "model", hidden=a.hidden, layers=a.layers, heads=a.heads,
                                 kv_heads=a.kv_heads, head_dim=64, intermediate=a.intermediate)
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    with tqdm(total=a.reps * len(CASES), desc="fresh processes") as bar:
        for rep in range(a.reps):
            runs["cold"].append(run_child(model_dir, tmp / f"cache-cold-{rep}", warm=False))
            bar.update()
            runs["warmed"].append(run_child(model_dir, tmp / f"cache-{rep}", warm=True))
            bar.update()
            runs["cached"].append(run_child(model_dir, tmp / f"cache-{rep}", warm=True))
            bar.update()
    median = {c: {k: statistics.median(r[k] for r in rs) for k in STEPS} for c, rs in runs.items()}
    table = Table(title=f"first version after a process starts (1% changed), medians of {a.reps}, seconds")
    for col in ("case", "warm()", "publish() holds the loop", "encoder thread", "first apply", "all"):
        table.add_column(col, justify="right")
    for c, m in median.items():
        table.add_row(c, *(f"{m[k]:.2f}" for k in STEPS), f"{sum(m.values()):.2f}")
    Console().print(table)
    model = {k: getattr(a, k) for k in ("hidden", "layers", "intermediate", "heads", "kv_heads")}
    path = write_json("cold_start", {"model": model, "reps": a.reps, "runs": runs,
                                     "median_s": median, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
