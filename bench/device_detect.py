"""Change detection where the weights live vs copying the model to the host, in one run.

Builds a 7B-shaped set of bf16 tensors (Llama-2-7B layout: hidden 4096, 32 layers, MLP 11008,
vocab 32000, untied; 6.74B parameters) on a CUDA device, flips low mantissa bits of ~1% of the
elements per step (training-like), and times, per step:

* **on device**: ``find_changes(backend="torch")`` on every tensor against a bf16 snapshot on
  the device (compare integer views, ``nonzero``, refresh the snapshot in place), with the
  positions (int32) and XORs copied to the host: what ``DeltaPublisher`` does for CUDA weights;
* **dense to host**: every tensor copied into preallocated pinned host buffers (the floor of any
  host-side detection: the whole model crosses PCIe every step);
* **numba on host**: the CPU path's scan (``find_changes(backend="numba")``) on those host copies
  against a host snapshot; the CPU path per step costs dense-to-host + this;
* references: a device-to-device and a host memcpy of the model.

Both detections must find the same positions and XORs (checked every step). Then two
``DeltaPublisher`` s (``detect="auto"`` and ``detect="numba"``) publish the same steps of the
device tensors to local folders (``external_base``, so no anchor is written), and their
``publish()`` times (detect + encode + digests; uploads run behind) and state digests are compared.

Medians over the steps after the first (warm-up: CUDA kernels, numba compilation).
JSON: ``bench/results/device_detect_<device>.json``.

    python -m bench.device_detect                      # CUDA, 7B-shaped (needs ~60 GB GPU, ~80 GB host)
    python -m bench.device_detect --device cpu         # the same code on the CPU at a small size
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from bench.common import memcpy_seconds, synchronize, write_json

PRESETS = {  # Llama-2-7B's layout; "small" keeps the same kinds of tensors at ~21M parameters
    "7b": {"hidden": 4096, "intermediate": 11008, "layers": 32, "vocab": 32000},
    "small": {"hidden": 512, "intermediate": 1376, "layers": 4, "vocab": 8000},
}


def model_shapes(hidden: int, intermediate: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (hidden, hidden)
        shapes[f"{p}mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[f"{p}mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[f"{p}mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    return shapes


def build(shapes: Mapping[str, tuple[int, ...]], device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """LLM-like bf16 weights on ``device``: N(0, 0.02), norms near 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for n, shape in shapes.items():
        t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        out[n] = (1.0 + 0.05 * t if n.endswith("norm.weight") else 0.02 * t).to(torch.bfloat16)
        del t
    return out


def step(state: Mapping[str, torch.Tensor], fraction: float, g: torch.Generator) -> None:
    """Flip one of the two lowest mantissa bits of ~``fraction`` of each tensor's elements, in place."""
    for t in state.values():
        bits = t.view(-1).view(torch.int16)
        k = max(1, int(bits.numel() * fraction))
        idx = torch.randint(0, bits.numel(), (k,), generator=g, device=t.device)
        flips = torch.randint(1, 3, (k,), generator=g, device=t.device, dtype=torch.int16)
        bits[idx] ^= flips  # repeated indices flip once: a change all the same


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def crossing_bytes(changes: Mapping, state: Mapping[str, torch.Tensor]) -> int:
    """What ``find_changes(backend="torch")`` moves to the host: int32 (int64 past 2**31
    elements) positions and element-wide XORs."""
    return sum(c.count * ((4 if state[n].numel() <= 2**31 - 1 else 8) + state[n].element_size())
               for n, c in changes.items())


def detection(live: dict[str, torch.Tensor], device: torch.device, steps: int, fraction: float,
              seed: int) -> dict:
    from shared.changes import find_changes, map_balanced

    names = sorted(live)
    sizes = [live[n].numel() * 2 for n in names]
    dense = sum(sizes)
    dev_snap = {n: t.clone() for n, t in live.items()}
    pin = device.type == "cuda"
    host_new = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for n, t in live.items()}
    host_snap = {n: t.to("cpu", copy=True) for n, t in live.items()}
    print(f"memcpy references ({dense / 1e6:.0f} MB) ...", flush=True)
    ref = {"device_memcpy_s": memcpy_seconds(live, 3), "host_memcpy_s": memcpy_seconds(host_snap, 3)}

    def on_device() -> dict:
        return {n: find_changes(dev_snap[n], live[n], update=True, backend="torch") for n in names}

    def to_host() -> None:
        for n in names:
            host_new[n].copy_(live[n], non_blocking=pin)

    def one_on_host(n: str):
        return find_changes(host_snap[n], host_new[n], update=True, threads=False, backend="numba")

    def on_host() -> dict:
        return dict(zip(names, map_balanced(one_on_host, names, sizes)))

    g = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for i in range(steps + 1):
        step(live, fraction, g)
        t_dev, dev = timed(on_device, device)
        t_d2h, _ = timed(to_host, device)
        t_cpu, cpu = timed(on_host, torch.device("cpu"))
        for n in names:
            a, b = dev[n], cpu[n]
            if (a is None) != (b is None) or (a is not None and not (
                    np.array_equal(a.positions, b.positions) and np.array_equal(a.xor, b.xor))):
                raise AssertionError(f"step {i}: {n}: device and host detection disagree")
        changed = sum(c.count for c in dev.values() if c is not None)
        row = {"device_detect_s": t_dev, "dense_to_host_s": t_d2h, "numba_on_host_s": t_cpu,
               "host_path_s": t_d2h + t_cpu, "changed": changed, "changed_fraction": changed / (dense // 2),
               "crossing_bytes": crossing_bytes({n: c for n, c in dev.items() if c is not None}, live),
               "dense_bytes": dense}
        print(f"step {i}{' (warm-up)' if i == 0 else ''}: device {t_dev * 1e3:.1f} ms, dense to host "
              f"{t_d2h * 1e3:.1f} ms, numba on host {t_cpu * 1e3:.1f} ms, {changed:,} changed", flush=True)
        if i:
            rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    for buffers in (dev_snap, host_new, host_snap):  # free them before the publishers take theirs
        buffers.clear()
    return {"median": med | ref, "per_step": rows}


def publishing(live: dict[str, torch.Tensor], steps: int, fraction: float, seed: int) -> dict:
    """``DeltaPublisher.publish()`` on the device tensors, device path vs host path, same steps."""
    try:
        from shared.chain import AnchorPolicy
        from shared.publisher import DeltaPublisher
    except ImportError as e:
        raise SystemExit(f"device_detect: the publisher part needs the project's dependencies ({e}); "
                         "the detection figures above were written; rerun with --publish-steps 0 to skip") from e
    device = next(iter(live.values())).device
    g = torch.Generator(device=device).manual_seed(seed + 1)
    out: dict[str, list[float]] = {"auto": [], "numba": []}
    with tempfile.TemporaryDirectory(prefix="bench-device-detect-") as tmp:
        pubs = {d: DeltaPublisher(live, f"{tmp}/{d}", detect=d, external_base="bench/7b-shaped",
                                  policy=AnchorPolicy(catchup_fraction=1e9)) for d in out}
        try:
            for i in range(steps + 1):
                step(live, fraction, g)
                reports = {}
                for d, pub in pubs.items():
                    synchronize(device)
                    reports[d] = pub.publish()
                    if i:  # the first also moves the base to the device snapshot
                        out[d].append(reports[d].encode_s)
                if reports["auto"].state_digest != reports["numba"].state_digest:
                    raise AssertionError(f"publish step {i}: the two paths disagree")
                print(f"publish {i}{' (warm-up)' if i == 0 else ''}: device path "
                      f"{reports['auto'].encode_s:.2f} s, host path {reports['numba'].encode_s:.2f} s, "
                      f"delta {reports['auto'].payload_bytes / 1e6:.1f} MB", flush=True)
            payload = reports["auto"].payload_bytes
            for pub in pubs.values():
                pub.flush()
        finally:
            for pub in pubs.values():
                pub.close()
    return {"publish_s": {d: statistics.median(v) for d, v in out.items()},
            "samples_s": out, "payload_bytes_last": payload}


def report(r: dict) -> None:
    m = r["detection"]["median"]
    dense = m["dense_bytes"]
    print(f"\n{r['device']}: {r['params'] / 1e9:.2f}B bf16 params ({dense / 1e9:.2f} GB), "
          f"{m['changed_fraction']:.2%} changed per step, medians of {r['steps']} steps")
    rows = [("on device: detect + positions/XORs to host", m["device_detect_s"]),
            ("dense copy to host" + (" (pinned)" if r["device"].startswith("cuda") else " (host memcpy)"),
             m["dense_to_host_s"]),
            ("numba detect on the host copies", m["numba_on_host_s"]),
            ("host path: dense copy + numba detect", m["host_path_s"]),
            ("reference: device memcpy of the model", m["device_memcpy_s"]),
            ("reference: host memcpy of the model", m["host_memcpy_s"])]
    print(f"{'method':<48}{'ms':>10}{'GB/s of model':>15}{'x on device':>13}")
    for label, s in rows:
        print(f"{label:<48}{s * 1e3:>10.1f}{dense / s / 1e9:>15.1f}{s / m['device_detect_s']:>13.1f}")
    print(f"bytes to the host per step: {m['crossing_bytes'] / 1e6:.1f} MB (changes) vs {dense / 1e6:.0f} MB "
          f"(dense), {dense / m['crossing_bytes']:.0f}x less")
    if r.get("publish"):
        p = r["publish"]["publish_s"]
        print(f"DeltaPublisher.publish(): device path {p['auto']:.2f} s, host path {p['numba']:.2f} s "
              f"({p['numba'] / p['auto']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--size", choices=sorted(PRESETS), help="default: 7b on CUDA, small on the CPU")
    ap.add_argument("--layers", type=int, help="override the preset's layer count (a quicker run)")
    ap.add_argument("--fraction", type=float, default=0.01, help="elements changed per step (default 0.01)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up (default 5)")
    ap.add_argument("--publish-steps", type=int, default=2,
                    help="timed DeltaPublisher steps per path after one warm-up (default 2; 0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"device_detect: no CUDA device here (torch {torch.__version__}, "
                 "torch.cuda.is_available() is False). Run it on a GPU machine, or pass --device cpu "
                 "to run the same code on the CPU at a small size.")
    if device.type not in ("cuda", "cpu"):
        sys.exit(f"device_detect: --device {a.device}: cuda, cuda:N or cpu")
    size = dict(PRESETS[a.size or ("7b" if device.type == "cuda" else "small")])
    if a.layers is not None:
        size["layers"] = a.layers
    shapes = model_shapes(**size)
    params = sum(int(np.prod(s)) for s in shapes.values())
    name = "cuda" if device.type == "cuda" else "cpu"
    print(f"building {len(shapes)} bf16 tensors, {params / 1e9:.2f}B params, on {device} ...", flush=True)
    live = build(shapes, device, a.seed)
    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if name == "cuda" else "cpu",
              "size": size, "params": params, "tensors": len(shapes), "fraction": a.fraction, "steps": a.steps,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result["detection"] = detection(live, device, a.steps, a.fraction, a.seed)
    gc.collect()
    path = write_json(f"device_detect_{name}", result)
    if a.publish_steps:
        result["publish"] = publishing(live, a.publish_steps, a.fraction, a.seed)
        path = write_json(f"device_detect_{name}", result)
    report(result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
