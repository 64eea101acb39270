"""Scale model: per-version time and bytes from 0.6B to 1T parameters, dense vs deltas.

Measured here, in this process, on AdamW trajectories (random gradients on LLM-like bf16
weights with fp32 master weights, ``bench.codec``'s model and trajectory) with the learning rate
calibrated to ~1%, ~3% and ~5% of elements changed per step: the cost of change detection per
model element, encoding per changed element, the state digest per byte, decoding (+ gathering
the old bits) and the scatter per changed element, a bare ``index_copy_`` for reference, bytes
per changed element, and a memcpy per byte.

Projected from those, for a bf16 model of P parameters changing a fraction f per version:

* dense: ``2P`` bytes through the bucket at ``--bandwidth`` GB/s, then loaded at memcpy speed;
* deltas: detection + encoding ``P x (its cost per model element at f)`` (timed together, so no
  noisy difference of two timings enters) + the state digest ``2P x digest`` on the trainer
  (``--digests every``; with the default ``anchors`` only an anchor's digest, amortized over
  the ``1 / (f x bytes/change)`` versions between anchors), ``fP x bytes/change`` through the
  bucket, ``fP x (decode + scatter)`` on the replica; trainer
  and replica work split over ``--workers`` parallel workers (trainer ranks and replica shards),
  each as fast as this machine measured it. Steps run one after the other (no overlap), and
  detection is the host's (numba), so the projection is an upper bound for this implementation.

Beside it, published figures (NeMo-DCR, Fireworks), marked as such. JSON and a log-log plot go to
``bench/results/scale.{json,png}``; every number in them is tagged measured, projected or published.

    python -m bench.scale [--bandwidth 1.0] [--workers 8] [--size mid|small]
    python -m bench.scale --reuse --bandwidth 0.33     # project the last measurement again
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from bench.codec import Case, build_model, trajectory
from bench.common import RESULTS, int32_bf16_bytes, median_time, memcpy_seconds, write_json

FRACTIONS = (0.01, 0.03, 0.05)
SIZES = {"small": {"hidden": 512, "layers": 8, "intermediate": 1536},  # ~26M, as in bench.codec
         "mid": {"hidden": 768, "layers": 12, "intermediate": 2048}}  # ~79M
PARAMS_B = (0.6, 1.7, 4, 8, 14, 32, 70, 120, 235, 405, 671, 1000)
CALIBRATION_LR = 1e-6
GB = 1e9
GIB = 2**30

# Published per-version figures, quoted as published (not measured here).
PUBLISHED = [
    {"source": "NeMo-DCR", "params": 120e9, "dense_bytes": 247e9, "dense_s": 750.0, "delta_s": [22.6, 24.5],
     "fraction": 0.03, "note": "120B, 247 GB: full sync 750 s vs delta 22.6-24.5 s at 3% change"},
    {"source": "NeMo-DCR", "params": 1e12, "dense_s": 87.5 * 60, "delta_s": [150.0, 150.0],
     "note": "1T: full sync 87.5 min vs delta 150 s"},
    {"source": "Fireworks", "params": 1e12, "dense_bytes": 2**40, "delta_bytes": 20.3 * GIB,
     "note": "~20.3 GiB delta per 1 TB of checkpoint"},
]


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16) for n, t in state.items()}


def changed_fraction(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    changed = sum(int((base[n].view(-1).view(torch.int16) != new[n].view(-1).view(torch.int16)).sum()) for n in new)
    return changed / sum(t.numel() for t in new.values())


def calibrate(size: str) -> float:
    """Changed fraction per unit of learning rate after Adam's first step (about linear here)."""
    from shared.checkpoint import module_state

    case = Case(f"calibrate-{size}", "adamw", lr=CALIBRATION_LR, steps=3, **SIZES[size])
    model = build_model(case)
    live = module_state(model)
    snap, fractions = _bf16(live), []
    for step, _ in enumerate(trajectory(case, model)):
        new = _bf16(live)
        if step:
            fractions.append(changed_fraction(snap, new))
        snap = new
    return statistics.median(fractions) / CALIBRATION_LR


def measure_step(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], reps: int) -> dict:
    """Every per-element cost on one version pair; each timing a median of ``reps``."""
    from shared.apply import prepare, write_all
    from shared.changes import find_changes, map_balanced
    from shared.codec import DeltaFile, build_delta, encode_state, save_delta
    from shared.digest import tensor_digest
    from shared.fingerprint import fingerprints

    names = sorted(new)
    sizes = [new[n].numel() * 2 for n in names]
    numel, dense = sum(new[n].numel() for n in names), sum(sizes)
    scratch = {n: t.clone() for n, t in base.items()}

    def warm_median(fn) -> float:  # the first call loads kernels and touches fresh pages
        fn()
        return median_time(fn, reps)

    detect_s = warm_median(lambda: map_balanced(
        lambda n: find_changes(scratch[n], new[n], threads=False), names, sizes))
    digests = {n: tensor_digest(new[n]) for n in names}
    digest_s = warm_median(lambda: map_balanced(lambda n: tensor_digest(new[n]), names, sizes))
    # detection included; the new fingerprints from the base's in O(changes), as a publisher does
    fps = fingerprints(scratch)
    encode_s = warm_median(lambda: encode_state(scratch, new, digests=digests, base_fingerprints=fps))
    header, tensors = build_delta(encode_state(scratch, new, digests=digests, base_fingerprints=fps), version=1,
                                  base_version=0, base_commitment="")
    blob = save_delta(header, tensors)
    changed = header.changed
    positions = {n: torch.nonzero(base[n].view(-1).view(torch.int16) != new[n].view(-1).view(torch.int16))
                 .reshape(-1) for n in names}
    # decode + gather before the pause, then the scatter (index_copy_ of new bits): the replica's split
    decode, scatter = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        patches = prepare(DeltaFile.from_bytes(blob), scratch, in_place=False)
        t1 = time.perf_counter()
        write_all(patches)
        t2 = time.perf_counter()
        if not all(torch.equal(scratch[n].view(torch.int16), new[n].view(torch.int16)) for n in names):
            raise AssertionError("the delta did not rebuild the new state exactly")
        for p in patches:
            p.revert()
        decode.append(t1 - t0)
        scatter.append(t2 - t1)
    flat = {n: scratch[n].view(-1).view(torch.int16) for n in names}
    vals = {n: new[n].view(-1).view(torch.int16)[p] for n, p in positions.items()}
    index_copy_s = warm_median(lambda: [flat[n].index_copy_(0, p, vals[n]) for n, p in positions.items()])
    return {"numel": numel, "dense_bytes": dense, "changed": changed, "changed_fraction": changed / numel,
            "delta_bytes": len(blob), "int32_bf16_bytes": int32_bf16_bytes(positions, new),
            "detect_s": detect_s, "encode_with_detect_s": encode_s, "digest_s": digest_s,
            "decode_s": statistics.median(decode[1:]), "scatter_s": statistics.median(scatter[1:]),
            "index_copy_s": index_copy_s, "memcpy_s": memcpy_seconds(new, reps)}


def per_element(m: dict) -> dict:
    """Per-element costs (ns) and bytes from one fraction's medians."""
    c = m["changed"]
    return {"changed_fraction": m["changed_fraction"],
            "detect_ns_per_element": m["detect_s"] / m["numel"] * 1e9,
            # what the projection scales: detection + encoding, timed together, per model element at this f
            "detect_encode_ns_per_element": m["encode_with_detect_s"] / m["numel"] * 1e9,
            "encode_ns_per_change": (m["encode_with_detect_s"] - m["detect_s"]) / c * 1e9,
            "digest_ns_per_byte": m["digest_s"] / m["dense_bytes"] * 1e9,
            "decode_ns_per_change": m["decode_s"] / c * 1e9,
            "scatter_ns_per_change": m["scatter_s"] / c * 1e9,
            "index_copy_ns_per_change": m["index_copy_s"] / c * 1e9,
            "bytes_per_change": m["delta_bytes"] / c,
            "int32_bf16_bytes_per_change": m["int32_bf16_bytes"] / c,
            "memcpy_ns_per_byte": m["memcpy_s"] / m["dense_bytes"] * 1e9}


def measure(size: str, steps: int, reps: int) -> dict:
    from shared.checkpoint import module_state

    per_lr = calibrate(size)
    out = {}
    for target in FRACTIONS:
        case = Case(f"adamw-{size}-{target:.0%}", "adamw", lr=target / per_lr, steps=steps + 1, **SIZES[size])
        model = build_model(case)
        live = module_state(model)
        snap, rows = _bf16(live), []
        for step, _ in enumerate(trajectory(case, model)):
            new = _bf16(live)
            if step:  # Adam's first step moves every weight by exactly lr: not representative
                rows.append(measure_step(snap, new, reps))
            snap = new
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[f"{target:.0%}"] = {"target": target, "lr": case.lr, "params": med["numel"], "median": med,
                                "per_element": per_element(med), "steps": rows}
        print(f"measured ~{target:.0%}: {med['changed_fraction']:.2%} changed, "
              f"{out[f'{target:.0%}']['per_element']['bytes_per_change']:.3f} B/change", flush=True)
    return out


def project(measured: dict, bandwidth_GBps: float, workers: int, digests: str = "anchors") -> list[dict]:
    """Per-version time and bytes for each size, dense and at each measured fraction.
    ``digests``: the publisher's (``"every"``: the whole state hashed per version; ``"anchors"``:
    only at anchors, which the default policy makes every ``1 / (f x B/change)`` versions, so
    that per version is the anchor's digest times ``f x B/change``)."""
    bw = bandwidth_GBps * GB
    memcpy_ns = statistics.median(m["per_element"]["memcpy_ns_per_byte"] for m in measured.values())
    rows = []
    for pb in PARAMS_B:
        p = pb * 1e9
        dense_bytes = 2 * p
        row = {"params": p, "dense_bytes": dense_bytes, "dense_transfer_s": dense_bytes / bw,
               "dense_load_s": dense_bytes * memcpy_ns / 1e9 / workers}
        row["dense_s"] = row["dense_transfer_s"] + row["dense_load_s"]
        for key, m in measured.items():
            e, changed = m["per_element"], m["target"] * p
            detect_encode = p * e["detect_encode_ns_per_element"] / 1e9 / workers
            digest = dense_bytes * e["digest_ns_per_byte"] / 1e9 / workers
            if digests == "anchors":
                digest *= min(1.0, m["target"] * e["bytes_per_change"])
            trainer = detect_encode + digest
            delta_bytes = changed * e["bytes_per_change"]
            replica = changed * (e["decode_ns_per_change"] + e["scatter_ns_per_change"]) / 1e9 / workers
            pause = changed * e["scatter_ns_per_change"] / 1e9 / workers
            row[key] = {"delta_bytes": delta_bytes, "trainer_s": trainer, "detect_encode_s": detect_encode,
                        "digest_s": digest, "transfer_s": delta_bytes / bw,
                        "replica_s": replica, "pause_s": pause,
                        "total_s": trainer + delta_bytes / bw + replica}
        rows.append(row)
    return rows


def fmt_bytes(b: float) -> str:
    return f"{b / 1e12:.2f} TB" if b >= 1e12 else f"{b / 1e9:.1f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def fmt_params(p: float) -> str:
    return f"{p / 1e12:g}T" if p >= 1e12 else f"{p / 1e9:g}B" if p >= 1e9 else f"{p / 1e6:.0f}M"


def fmt_s(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 600 else f"{s:.1f} s" if s >= 1 else f"{s * 1e3:.0f} ms"


def report(result: dict) -> None:
    console = Console(width=200)
    m = Table(title="measured here (per element, medians; this machine, "
                    f"{result['measured_on']['threads']} torch threads)")
    for col in ["changed (target)", "B/change", "int32+bf16 B/change", "detect ns/elem", "digest ns/B",
                "encode ns/change", "decode ns/change", "scatter ns/change", "index_copy_ ns/change",
                "memcpy ns/B"]:
        m.add_column(col, justify="right")
    for key, v in result["measured"].items():
        e = v["per_element"]
        m.add_row(f"{e['changed_fraction']:.2%} ({key})", f"{e['bytes_per_change']:.3f}",
                  f"{e['int32_bf16_bytes_per_change']:.2f}", f"{e['detect_ns_per_element']:.2f}",
                  f"{e['digest_ns_per_byte']:.3f}", f"{e['encode_ns_per_change']:.0f}",
                  f"{e['decode_ns_per_change']:.0f}", f"{e['scatter_ns_per_change']:.0f}",
                  f"{e['index_copy_ns_per_change']:.0f}", f"{e['memcpy_ns_per_byte']:.3f}")
    console.print(m)
    a = result["assumptions"]
    t = Table(title=f"projected per version: bucket {a['bandwidth_GBps']} GB/s, {a['workers']} workers "
                    "(each as fast as this machine); published figures beside")
    for col in ["kind", "params", "dense bytes", "dense time", *[f"ours {k} bytes" for k in FRACTIONS_KEYS],
                *[f"ours {k} time" for k in FRACTIONS_KEYS], "published"]:
        t.add_column(col, justify="right")
    for r in result["projected"]:
        pub = "; ".join(p["note"] for p in PUBLISHED if p["params"] == r["params"])
        t.add_row("projected", fmt_params(r["params"]), fmt_bytes(r["dense_bytes"]), fmt_s(r["dense_s"]),
                  *[fmt_bytes(r[k]["delta_bytes"]) for k in FRACTIONS_KEYS],
                  *[fmt_s(r[k]["total_s"]) for k in FRACTIONS_KEYS], pub or "")
    console.print(t)


FRACTIONS_KEYS = [f"{f:.0%}" for f in FRACTIONS]


def measured_compute_s(v: dict) -> float:
    """The measured model's own per-version work on this machine: detect + encode + digest +
    decode + scatter (no bucket)."""
    m = v["median"]
    return m["encode_with_detect_s"] + m["digest_s"] + m["decode_s"] + m["scatter_s"]


def markdown(result: dict, sizes_b: tuple[float, ...] = (0.6, 8, 32, 70, 120, 235, 671, 1000)) -> str:
    """The README's table: one measured row, projected rows, published figures beside."""
    a = result["assumptions"]
    head = ["params", "kind", "dense bytes", "dense time", *[f"ours {k}: bytes, time (trainer + bucket + replica)"
                                                            for k in FRACTIONS_KEYS], "published (not ours)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ms = next(iter(result["measured"].values()))["median"]
    cells = [f"{fmt_bytes(v['median']['delta_bytes'])} at {v['median']['changed_fraction']:.2%}, "
             f"{fmt_s(measured_compute_s(v))} (compute)" for v in result["measured"].values()]
    lines.append(f"| {fmt_params(ms['numel'])} | **measured** here, 1 worker, no bucket | "
                 f"{fmt_bytes(ms['dense_bytes'])} | {fmt_s(ms['memcpy_s'])} (memcpy) | " + " | ".join(cells) + " | |")
    for r in result["projected"]:
        if r["params"] / 1e9 not in sizes_b:
            continue
        ours = [f"{fmt_bytes(r[k]['delta_bytes'])}, {fmt_s(r[k]['total_s'])} = {fmt_s(r[k]['trainer_s'])} + "
                f"{fmt_s(r[k]['transfer_s'])} + {fmt_s(r[k]['replica_s'])}" for k in FRACTIONS_KEYS]
        pub = "; ".join(f"{p['source']}: {p['note']}" for p in result["published"] if p["params"] == r["params"])
        lines.append(f"| {fmt_params(r['params'])} | projected | {fmt_bytes(r['dense_bytes'])} | "
                     f"{fmt_s(r['dense_s'])} | " + " | ".join(ours) + f" | {pub} |")
    lines.append(f"\nProjected at a {a['bandwidth_GBps']} GB/s bucket and {a['workers']} workers.")
    return "\n".join(lines)


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["projected"]
    x = [r["params"] for r in rows]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
    ax_t.plot(x, [r["dense_s"] for r in rows], "k-", label="dense (projected)")
    ax_b.plot(x, [r["dense_bytes"] for r in rows], "k-", label="dense")
    for key, style in zip(FRACTIONS_KEYS, ("-", "--", ":")):
        ax_t.plot(x, [r[key]["total_s"] for r in rows], "C0" + style, label=f"deltasync {key} (projected)")
        ax_b.plot(x, [r[key]["delta_bytes"] for r in rows], "C0" + style, label=f"deltasync {key} (projected)")
    ax_t.plot(x, [r["3%"]["transfer_s"] for r in rows], color="0.6", lw=1,
              label="deltasync 3%: bucket transfer alone (projected)")
    for key, v in result["measured"].items():  # the measured points themselves
        ax_b.plot([v["params"]], [v["median"]["delta_bytes"]], "C0o", ms=5)
        ax_t.plot([v["params"]], [measured_compute_s(v)], "C0o", ms=5)
    ax_b.plot([], [], "C0o", label="deltasync (measured here)")
    ax_t.plot([], [], "C0o", label="deltasync compute, 1 worker (measured here)")
    for p in PUBLISHED:
        if "dense_s" in p:
            ax_t.plot([p["params"]], [p["dense_s"]], "C3s", ms=7)
            lo, hi = p["delta_s"]
            ax_t.errorbar([p["params"]], [(lo + hi) / 2], yerr=[[(hi - lo) / 2], [(hi - lo) / 2]], fmt="C3^", ms=7)
        if "delta_bytes" in p:  # per 1 TB of checkpoint: scaled to a bf16 checkpoint of that many params
            scale = 2 * p["params"] / p["dense_bytes"]
            ax_b.plot([p["params"]], [p["delta_bytes"] * scale], "C2^", ms=7)
        if "dense_bytes" in p and p["source"] == "NeMo-DCR":
            ax_b.plot([p["params"]], [p["dense_bytes"]], "C3s", ms=7)
    ax_t.plot([], [], "C3s", label="NeMo-DCR full sync (published)")
    ax_t.plot([], [], "C3^", label="NeMo-DCR delta (published)")
    ax_b.plot([], [], "C3s", label="NeMo-DCR checkpoint (published)")
    ax_b.plot([], [], "C2^", label="Fireworks delta, 20.3 GiB/TB x bf16 size (published)")
    a = result["assumptions"]
    ax_t.set_title(f"time per version ({a['bandwidth_GBps']} GB/s bucket, {a['workers']} workers)")
    ax_b.set_title("bytes per version")
    for ax, label in ((ax_t, "seconds"), (ax_b, "bytes")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (bf16)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "scale.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", type=float, default=1.0,
                    help="bucket bandwidth in GB/s, trainer to replica, for dense and deltas alike "
                         "(default 1.0, stated not measured; NeMo-DCR's 247 GB in 750 s is 0.33)")
    ap.add_argument("--workers", type=int, default=8,
                    help="parallel workers on each side (trainer ranks, replica shards), each as fast as "
                         "this machine (default 8: one 8-GPU node)")
    ap.add_argument("--size", choices=sorted(SIZES), default="mid", help="model measured (default mid, ~79M)")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per fraction after Adam's first")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per timing (median)")
    ap.add_argument("--digests", choices=("every", "anchors"), default="anchors",
                    help="the publisher's blake3 digests: every version, or only at anchors (default; "
                         "amortized over the versions between anchors)")
    ap.add_argument("--reuse", action="store_true",
                    help="take the measured part from bench/results/scale.json and only project again")
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.reuse:
        old = json.loads((RESULTS / "scale.json").read_text())
        measured_on, measured = old["measured_on"], old["measured"]
    else:
        measured = measure(a.size, a.steps, a.reps)
        measured_on = {"size": a.size, "threads": torch.get_num_threads(), "steps": a.steps,
                       "reps": a.reps, "seconds": time.perf_counter() - t0}
    result = {"measured_on": measured_on,
              "measured": measured,
              "assumptions": {"bandwidth_GBps": a.bandwidth, "workers": a.workers, "dtype": "bf16 (2 B/param)",
                              "digests": a.digests,
                              "kind": "projected",
                              "dense_s": "2P / bandwidth + 2P x memcpy / workers",
                              "delta_s": "(P x detect+encode per element at f + 2P x digest [x f x B/change "
                                         "with --digests anchors: one anchor's per 1 / (f x B/change) versions]) "
                                         "/ workers + "
                                         "fP x B/change / bandwidth + fP x (decode + scatter) / workers",
                              "on_device_detection": "not in the projection: measured by bench/device_detect.py "
                                                     "on a GPU (host detection is assumed here)"},
              "projected": project(measured, a.bandwidth, a.workers, a.digests),
              "published": PUBLISHED}
    report(result)
    print(markdown(result))
    path = write_json("scale", result)
    plot(result)
    print(f"wrote {path} and {RESULTS / 'scale.png'}")


if __name__ == "__main__":
    main()
