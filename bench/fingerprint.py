"""Fingerprint benchmark: what the linear fingerprint costs next to the blake3 digest and memcpy,
and what its O(changes) update saves at ~1% change, all measured in the same process.

On a bf16 state shaped like a Qwen3 model (default ~61M parameters, the shape of
``bench.apply_vllm``'s model; LLM-like values), medians over ``--reps``:

* memcpy: every tensor copied once into preallocated buffers (the machine's floor);
* blake3: ``shared.digest.tensor_digest`` of every tensor (what each version costs today);
* fingerprint, numba (the CPU path: tensors over the shared thread pool, chunks on threads);
* fingerprint, torch int64 ops on the CPU (the any-device path; on the CPU it is the check, not
  the fast path), at torch's default thread count and on one thread;
* update at ``--fraction`` change: ``fingerprint_delta`` over every tensor's changed positions,
  without and with gathering the old bits there (a replica gathers them anyway; a trainer has
  them in its snapshot), numba and torch, against a full numba recompute.

Every method's result is checked equal to the others' before it is reported.

    .venv/bin/python -m bench.fingerprint [--quick] [--reps 5] [--hidden 768 --layers 7 ...]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from rich.console import Console
from rich.table import Table

from bench.common import add_model_args, median_time, memcpy_seconds, write_json


def qwen3_shapes(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 vocab: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Qwen3 causal LM with tied embeddings."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        }
    return shapes


def build_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """LLM-like bf16 values: small matrices, norms near 1 (as shared.tiny_model builds them)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if "norm" in name:
            state[name] = (1.0 + 0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        else:
            state[name] = (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    return state


def sparse_change(state: dict[str, torch.Tensor], fraction: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """Positions (sorted, int64) of about ``fraction`` of each tensor's elements, where a training
    step would flip the low mantissa bits."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.nonzero(torch.rand(t.numel(), generator=g) < fraction).reshape(-1) for n, t in state.items()}


def apply_change(state: dict[str, torch.Tensor], positions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    new = {}
    for n, t in state.items():
        flat = t.clone().reshape(-1).view(torch.int16)
        flat[positions[n]] ^= torch.randint(1, 4, (positions[n].numel(),), dtype=torch.int16)
        new[n] = flat.view(torch.bfloat16).reshape(t.shape)
    return new


def run(args: argparse.Namespace) -> dict:
    from shared.digest import tensor_digest
    from shared.fingerprint import fingerprint_delta, fingerprints

    shapes = qwen3_shapes(args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads, args.head_dim,
                          args.vocab)
    state = build_state(shapes)
    numel = sum(t.numel() for t in state.values())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"{len(state)} bf16 tensors, {numel / 1e6:.1f}M elements, {nbytes / 1e6:.0f} MB; "
          f"{torch.get_num_threads()} torch threads")
    fingerprints(state)  # compile (or load cached) kernels before timing
    reps = args.reps
    fp_numba = fingerprints(state)
    fp_torch = fingerprints(state, backend="torch")
    assert fp_numba == fp_torch, "numba and torch fingerprints differ"

    seconds = {
        "memcpy": memcpy_seconds(state, reps),
        "blake3": median_time(lambda: [tensor_digest(t) for t in state.values()], reps),
        "numba": median_time(lambda: fingerprints(state), reps),
        "torch_cpu": median_time(lambda: fingerprints(state, backend="torch"), max(1, reps // 2)),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's OpenMP suffers most when other processes share the cores
    try:
        seconds["memcpy_1thread"] = memcpy_seconds(state, reps)
        seconds["torch_cpu_1thread"] = median_time(lambda: fingerprints(state, backend="torch"), max(1, reps // 2))
    finally:
        torch.set_num_threads(threads)

    # the update at ~fraction change
    positions = sparse_change(state, args.fraction)
    new = apply_change(state, positions)
    changed = sum(p.numel() for p in positions.values())
    flat_old = {n: t.reshape(-1) for n, t in state.items()}
    old_bits = {n: flat_old[n][p] for n, p in positions.items()}
    new_bits = {n: new[n].reshape(-1)[p] for n, p in positions.items()}

    def update(backend: str, gather: bool):
        def go() -> dict:
            return {n: fp_numba[n] + fingerprint_delta(
                p, flat_old[n][p] if gather else old_bits[n], new_bits[n], 16, backend=backend)
                for n, p in positions.items()}
        return go

    fp_new = fingerprints(new)
    for backend in ("numba", "torch"):
        assert update(backend, True)() == fp_new, f"{backend} update differs from a recompute"
    assert fp_new != fp_numba
    seconds |= {
        "update_numba": median_time(update("numba", False), reps),
        "update_numba_gather": median_time(update("numba", True), reps),
        "update_torch": median_time(update("torch", False), reps),
        "update_torch_gather": median_time(update("torch", True), reps),
        "recompute_numba": median_time(lambda: fingerprints(new), reps),
    }
    return {"params": numel, "loadavg_1min": os.getloadavg()[0], "cpus": os.cpu_count(), "bytes": nbytes, "tensors": len(state), "changed": changed,
            "changed_fraction": changed / numel, "reps": reps, "seconds_median": seconds,
            "GBps": {k: nbytes / s / 1e9 for k, s in seconds.items() if not k.startswith("update")},
            "shape": {k: getattr(args, k) for k in ("hidden", "layers", "intermediate", "heads", "kv_heads",
                                                    "head_dim", "vocab")}}


def report(r: dict) -> None:
    s, gbps = r["seconds_median"], r["GBps"]
    floor = min(s["memcpy"], s["memcpy_1thread"])  # the faster copy is the machine's floor
    full = Table(title=f"full pass over {r['params'] / 1e6:.0f}M bf16 elements ({r['bytes'] / 1e6:.0f} MB), "
                       f"medians of {r['reps']}; {r['cpus']} CPUs, load average {r['loadavg_1min']:.1f} at the end")
    for col in ["method", "ms", "GB/s", "vs memcpy", "vs blake3"]:
        full.add_column(col, justify="right")
    for key, label in [("memcpy", "memcpy"), ("memcpy_1thread", "memcpy, 1 thread"), ("blake3", "blake3 tensor digest"), ("numba", "fingerprint numba"),
                       ("torch_cpu", "fingerprint torch CPU"), ("torch_cpu_1thread", "fingerprint torch CPU, 1 thread")]:
        full.add_row(label, f"{s[key] * 1e3:.1f}", f"{gbps[key]:.2f}", f"{floor / s[key]:.2f}x",
                     f"{s['blake3'] / s[key]:.2f}x")
    upd = Table(title=f"update at {r['changed_fraction']:.2%} change ({r['changed']:,} elements)")
    for col in ["method", "ms", "ns per change", "vs recompute", "vs blake3"]:
        upd.add_column(col, justify="right")
    for key, label in [("update_numba", "fingerprint_delta numba"),
                       ("update_numba_gather", "gather old + fingerprint_delta numba"),
                       ("update_torch", "fingerprint_delta torch CPU"),
                       ("update_torch_gather", "gather old + fingerprint_delta torch CPU"),
                       ("recompute_numba", "full recompute numba")]:
        upd.add_row(label, f"{s[key] * 1e3:.2f}", f"{s[key] / max(r['changed'], 1) * 1e9:.1f}",
                    f"{s[key] / s['recompute_numba']:.3f}x", f"{s[key] / s['blake3']:.3f}x")
    console = Console(width=140)
    console.print(full)
    console.print(upd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads for the run (default: torch's); 1 avoids OpenMP stalls on busy cores")
    ap.add_argument("--quick", action="store_true", help="a ~3M model, 3 reps (a smoke test)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads, a.reps = 256, 2, 1024, 4, 2, 3
    t0 = time.perf_counter()
    r = run(a)
    report(r)
    path = write_json("fingerprint", r | {"wall_s": time.perf_counter() - t0})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
