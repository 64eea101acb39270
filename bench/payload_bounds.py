"""Where a delta's bytes go, against what an ideal coder of the same information would need.

For the real-gradient trajectories of :mod:`bench.codec` (next-token loss on a locally built
Qwen3, fp32 AdamW master weights published as bf16), per step after Adam's first: the default
delta's bytes per changed element split into positions, values and the rest (the safetensors and
deltasync headers), beside order-0 entropy bounds (per tensor, no cost for describing the model):

* **positions, independent**: ``numel * H(changed / numel)`` bits per tensor, what any coder of
  positions that knows nothing else needs (the default Rice code sits at it);
* **positions | exponent**: the same per exponent class of the base element, what a coder that
  conditions on the base (``compact``) could reach;
* **values**: the entropy of the signed step of each change in bf16's ordered integers, per
  tensor, and per exponent class of the base element.

Issue 11 asks for <= 1.0 B a change by default; this shows which part keeps each model above it.

    .venv/bin/python -m bench.payload_bounds [--only 26M,79M]

JSON: ``bench/results/payload_bounds.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

PARTS = ("positions", "values", "headers", "total")
BOUNDS = ("positions_independent", "positions_given_exponent", "values", "values_given_exponent")


def _h2(p: np.ndarray) -> np.ndarray:
    """Binary entropy in bits (0 at 0 and 1)."""
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    return np.where((p >= 1.0) | (p <= 1e-300), 0.0, -(p * np.log2(p) + q * np.log2(q)))


def _entropy_bits(x: np.ndarray) -> float:
    """Order-0 entropy of the values of ``x``, in bits for all of them."""
    if x.size == 0:
        return 0.0
    _, counts = np.unique(x, return_counts=True)
    return float(-(counts * np.log2(counts / x.size)).sum())


def bounds(old: np.ndarray, new: np.ndarray) -> dict[str, float]:
    """The four bounds (bits) for one tensor's bf16 bits before and after."""
    changed = old != new
    count = int(changed.sum())
    if count == 0:
        return dict.fromkeys(BOUNDS, 0.0)
    exponent = (old.astype(np.int64) >> 7) & 0xFF
    classes, sizes = np.unique(exponent, return_counts=True)
    hits = np.bincount(np.searchsorted(classes, exponent[changed]), minlength=classes.size)

    def ordered(bits: np.ndarray) -> np.ndarray:  # bf16 patterns in the order of their values
        b = bits.astype(np.int64)
        return np.where(b & 0x8000, -(b & 0x7FFF), b)

    step = ordered(new[changed]) - ordered(old[changed])
    cls = exponent[changed]
    return {"positions_independent": float(old.size * _h2(np.array(count / old.size))),
            "positions_given_exponent": float((sizes * _h2(hits / sizes)).sum()),
            "values": _entropy_bits(step),
            "values_given_exponent": sum(_entropy_bits(step[cls == c]) for c in np.unique(cls))}


def measure(case) -> list[dict]:
    from bench.codec import build_model, trajectory
    from shared.checkpoint import module_state
    from shared.codec import build_delta, encode_state, save_delta

    model = build_model(case)
    live = module_state(model)
    snap = {n: t.detach().to(torch.bfloat16) for n, t in live.items()}
    steps = []
    for step, _ in enumerate(trajectory(case, model)):
        new = {n: t.detach().to(torch.bfloat16) for n, t in live.items()}
        header, blobs = build_delta(encode_state(snap, new), version=step + 1, base_version=step,
                                    base_commitment="")
        data = save_delta(header, blobs)
        if step:  # Adam's first step moves every weight by exactly lr: not representative
            changed = header.changed
            size = {"positions": sum(b.numel() for k, b in blobs.items() if k.endswith("::pos")),
                    "values": sum(b.numel() for k, b in blobs.items() if k.endswith("::val"))}
            size["headers"] = len(data) - size["positions"] - size["values"]
            size["total"] = len(data)
            bits = dict.fromkeys(BOUNDS, 0.0)
            for n in new:
                for k, v in bounds(snap[n].view(-1).view(torch.uint16).numpy(),
                                   new[n].view(-1).view(torch.uint16).numpy()).items():
                    bits[k] += v
            steps.append({"changed_fraction": changed / header.numel,
                          **{f"{k}_B": v / changed for k, v in size.items()},
                          **{f"bound_{k}_B": v / 8 / changed for k, v in bits.items()}})
        snap = new
    return steps


def main() -> None:
    from rich.console import Console
    from rich.table import Table
    from tqdm.auto import tqdm

    from bench.codec import Case
    from bench.common import write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="26M,79M")
    a = ap.parse_args()
    sizes = {"26M": dict(hidden=512, layers=8, intermediate=1536),
             "79M": dict(hidden=768, layers=12, intermediate=2048)}
    results = {}
    for key in tqdm(a.only.split(","), desc="models"):
        case = Case(f"real-{key}-lr3e-7", "real", lr=3e-7, steps=4, **sizes[key])  # ~1% changed
        steps = measure(case)
        results[case.name] = {"steps": steps, "median": {k: statistics.median(s[k] for s in steps) for k in steps[0]}}
    table = Table(title="B per changed element at ~1%, medians: the default delta (positions, values, headers) "
                        "and order-0 bounds (H: independent; H|exp: per exponent class of the base)")
    for col in ("case", "chg", "pos", "val", "hdr", "total", "pos H", "pos H|exp", "val H", "val H|exp"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        m = r["median"]
        table.add_row(name.split("-")[1], f"{m['changed_fraction']:.2%}", *(f"{m[f'{k}_B']:.3f}" for k in PARTS),
                      *(f"{m[f'bound_{k}_B']:.3f}" for k in BOUNDS))
    Console().print(table)
    path = write_json("payload_bounds", {"results": results, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
