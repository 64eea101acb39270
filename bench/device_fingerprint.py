"""GPU check of the linear fingerprint: ``shared.fingerprint``'s torch path with ``device="cuda"``
(the same code as on the CPU) over a 7B-shaped set of bf16 tensors.

Checks, each exact (a mismatch exits non-zero):

* the GPU fingerprints of a sample of tensors (embeddings, lm_head, a whole first layer, the last
  layer's down projection, norms) equal the CPU numba fingerprints of their host copies;
* row-shard partials computed on the GPU with global starts sum to the whole tensor's;
* after a ~1% change of low mantissa bits in every tensor, base + ``fingerprint_delta`` on the
  GPU equals a full GPU recompute, and equals the numba delta on the sample.

Timings (medians, synchronised): the full GPU fingerprint of the state, a device-to-device copy
of it (the memcpy floor), the GPU update from the changed positions, and the numba CPU
fingerprint of the sample for scale. Results go to ``--out`` as JSON.

Needs a CUDA device; without one it stops at once with a message. On the project's device
machine ``blake3`` (imported by ``shared.digest``) is missing: carry its wheel, e.g.

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl blake3==1.0.11
    # run(carry=[".whl"]):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    PYTHONUNBUFFERED=1 python3 -m bench.device_fingerprint --out $OUT/device_fingerprint.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# Llama-2-7B's shape (untied lm_head) in Qwen3's names: 6.74B parameters, 13.5 GB in bf16
SEVEN_B = {"hidden": 4096, "layers": 32, "intermediate": 11008, "heads": 32, "kv_heads": 32, "head_dim": 128,
           "vocab": 32000}


TINY = {"hidden": 128, "layers": 2, "intermediate": 384, "heads": 2, "kv_heads": 2, "head_dim": 64, "vocab": 1000}


def require(device: str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench.device_fingerprint needs a CUDA device, and torch {torch.__version__} sees none "
                 f"(torch.cuda.is_available() is False): run it on a GPU machine "
                 f"(--device cpu --shape tiny is a dry run of the same checks).")
    return d


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_state(device: torch.device, shape: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    from bench.fingerprint import qwen3_shapes

    shapes = qwen3_shapes(**shape) | {"lm_head.weight": (shape["vocab"], shape["hidden"])}
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, s in shapes.items():
        x = torch.randn(s, generator=g, device=device)
        state[name] = (1.0 + 0.05 * x if "norm" in name else 0.02 * x).to(torch.bfloat16)
    return state


def sample_names(state: dict[str, torch.Tensor], layers: int) -> list[str]:
    first = [n for n in state if n.startswith("model.layers.0.")]
    return ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", *first,
            f"model.layers.{layers - 1}.mlp.down_proj.weight"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers for a quick try (default: the shape's)")
    ap.add_argument("--shape", choices=["7b", "tiny"], default="7b")
    ap.add_argument("--device", default="cuda", help="cuda (the check); cpu with --shape tiny: a dry run")
    ap.add_argument("--out", default=str(RESULTS / "device_fingerprint.json"))
    a = ap.parse_args()
    device = require(a.device)
    from shared.fingerprint import (
        ZERO,
        fingerprint_delta,
        fingerprints,
        tensor_fingerprint,
    )

    t_start = time.perf_counter()
    shape = SEVEN_B if a.shape == "7b" else TINY
    shape = shape | {"layers": a.layers or shape["layers"]}
    state = build_state(device, shape)
    numel = sum(t.numel() for t in state.values())
    nbytes = 2 * numel
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"{name}: {len(state)} bf16 tensors, {numel / 1e6:,.0f}M elements, "
          f"{nbytes / 1e9:.2f} GB", flush=True)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
        if not ok:
            failures.append(what)

    def on_device(s: dict[str, torch.Tensor]) -> dict:  # the torch path, also for a dry run on the CPU
        return fingerprints(s, device=device, backend="torch")

    fps = on_device(state)  # warm-up and the reference for what follows
    gpu_s = timed(lambda: on_device(state), a.reps, device)
    copies = {n: torch.empty_like(t) for n, t in state.items()}
    copy_s = timed(lambda: [copies[n].copy_(t) for n, t in state.items()], a.reps, device)
    copies.clear()

    # the sample on the CPU with numba
    names = sample_names(state, shape["layers"])
    host = {n: state[n].cpu() for n in names}
    fingerprints({"warm-up": host[names[0]][:1]})  # load the numba kernels before timing
    t0 = time.perf_counter()
    cpu_fps = fingerprints(host)
    numba_s = time.perf_counter() - t0
    sample_elems = sum(t.numel() for t in host.values())
    for n in names:
        check(cpu_fps[n] == fps[n], f"GPU torch == CPU numba: {n} {tuple(state[n].shape)}")
    big = state["lm_head.weight"]
    rows = big.shape[0] // 8
    partials = [tensor_fingerprint(big[r * rows:(r + 1) * rows], start=r * rows * big.shape[1], device=device,
                                   backend="torch") for r in range(8)]
    partials.append(tensor_fingerprint(big[8 * rows:], start=8 * rows * big.shape[1], device=device, backend="torch"))
    check(sum(partials, ZERO) == fps["lm_head.weight"], "8 row shards on the GPU sum to the whole lm_head")

    # ~fraction change of low mantissa bits everywhere; update from the changes vs a recompute
    g = torch.Generator(device=device).manual_seed(1)
    positions = {n: torch.nonzero(torch.rand(t.numel(), generator=g, device=device) < a.fraction).reshape(-1)
                 for n, t in state.items()}
    changed = sum(int(p.numel()) for p in positions.values())
    old_bits = {n: state[n].reshape(-1)[p] for n, p in positions.items()}
    new_bits = {n: (b.view(torch.int16) ^ torch.randint(1, 4, b.shape, generator=g, device=device,
                                                        dtype=torch.int16)).view(torch.bfloat16)
                for n, b in old_bits.items()}

    def update() -> dict:
        return {n: fps[n] + fingerprint_delta(p, old_bits[n], new_bits[n], 16, device=device, backend="torch")
                for n, p in positions.items()}

    predicted = update()
    update_s = timed(update, a.reps, device)
    gather_s = timed(lambda: [state[n].reshape(-1)[p] for n, p in positions.items()], a.reps, device)
    for n, p in positions.items():
        state[n].reshape(-1)[p] = new_bits[n]
    after = on_device(state)
    check(after == predicted, f"base + GPU fingerprint_delta == GPU recompute after {changed:,} changes")
    check(all(after[n] != fps[n] for n in positions if positions[n].numel()), "every changed tensor's fingerprint moved")
    for n in names:
        cpu_delta = fingerprint_delta(positions[n].cpu(), old_bits[n].cpu(), new_bits[n].cpu(), 16)
        check(cpu_fps[n] + cpu_delta == predicted[n], f"numba delta == GPU delta: {n}")

    result = {
        "device": name, "torch": torch.__version__, "python": platform.python_version(),
        "shape": shape, "tensors": len(state), "params": numel, "bytes": nbytes, "changed": changed,
        "reps": a.reps, "failures": failures,
        "seconds_median": {"gpu_fingerprint": gpu_s, "gpu_copy": copy_s, "gpu_update": update_s,
                           "gpu_gather_old": gather_s},
        "GBps": {"gpu_fingerprint": nbytes / gpu_s / 1e9, "gpu_copy": nbytes / copy_s / 1e9},
        "numba_sample": {"elements": sample_elems, "seconds": numba_s,
                         "GBps": 2 * sample_elems / numba_s / 1e9, "threads": torch.get_num_threads()},
        "wall_s": time.perf_counter() - t_start,
    }
    print(json.dumps(result, indent=1), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if failures:
        sys.exit(f"{len(failures)} checks failed")


if __name__ == "__main__":
    main()
