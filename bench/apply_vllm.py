"""Apply a ~1% bf16 delta to a live vLLM engine four ways, in one run, and compare.

* **deltasync pause**: what generation waits for on the replica: the staged ``index_copy_`` of
  precomputed new bits into the live parameters (``LiveWeights.write``), and the same measured
  around the worker call plus the prefix-cache reset. Afterwards a real server
  (``python -m rollout_space``) applies a few more such versions and its ``POST /update``
  reports give the pause as served: scheduler paused to resumed.
* **floor**: a bare ``index_copy_`` of the same new bits at the same positions into tensors of
  the same sizes (scratch copies of the parameters).
* **dense reload**: every checkpoint tensor of the target through the model's ``load_weights``
  (from memory, so it is a copy; from disk or over a network it is slower).
* **vLLM patches**: vLLM's own sparse path, ``load_checkpoint_weight_patches`` with indices and
  new values in checkpoint coordinates.

Staging (decode, map, gather, compute new bits, predict digests) happens while the replica
serves and is reported separately. Every method is checked bit for bit (live state digest) and
undone between repetitions. Medians are reported; JSON goes to ``bench/results/apply_vllm.json``.

    .venv/bin/python -m bench.apply_vllm [--layers 7 --hidden 768 ...] [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).resolve().parent / "results"


def _worker_bench(worker, delta_path: str, reps: int) -> dict:
    """Runs inside the vLLM worker (in this process): all four methods on the live model."""
    import torch
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    from shared.codec import DeltaFile
    from shared.digest import TORCH_DTYPES
    from shared.warmup import warm_in_background

    warm_in_background().join()  # the worker's kernel warm-up (started at init) off the cores first

    st = worker._deltasync_state
    weights, live = st.weights, st.weights.live
    model = worker.model_runner.model
    delta = DeltaFile.open(delta_path)
    base_sd = weights.live_state_digest()
    t0 = time.perf_counter()
    staged = weights.stage(delta, predict=True)
    stage_once = time.perf_counter() - t0
    target_sd = delta.header.state_digest

    # checkpoint-coordinate inputs for the other methods (built outside the timings)
    changes = list(delta.changes())
    sparse_patches, dense = [], []
    for c in changes:
        dtype_s, shape = weights.held.specs[c.name]
        dtype = TORCH_DTYPES[dtype_s]
        old = live.read(c.name).reshape(-1)
        bits = old.view(torch.int16)
        new_bits = c.new_bits(bits.index_select(0, c.positions))
        sparse_patches.append(CheckpointWeightPatch(c.name, tuple(shape), dtype,
                                                    new_bits.view(dtype), c.positions))
        full = old.clone()
        full.view(torch.int16).index_copy_(0, c.positions, new_bits)
        dense.append((c.name, full.view(shape)))
    floor_targets = [(p.target.clone(), p.positions, p.new) for p in staged.patches]

    def check(expect: str, what: str) -> None:
        got = weights.live_state_digest()
        if got != expect:
            raise AssertionError(f"{what}: live state digest {got[:12]} != {expect[:12]}")

    def undo() -> None:  # back to the base: old bits at the changed positions
        with torch.no_grad():
            for p in reversed(staged.patches):
                p.revert()

    out: dict[str, list[float]] = {k: [] for k in ("pause_write", "floor", "dense_reload",
                                                   "vllm_patches")}
    with torch.no_grad():
        for rep in range(reps):
            a = time.perf_counter()
            for target, pos, new in floor_targets:
                target.index_copy_(0, pos, new)
            out["floor"].append(time.perf_counter() - a)

            out["pause_write"].append(weights.write(staged))
            if rep == 0:
                check(target_sd, "deltasync")
            weights.revert(staged)
            if rep == 0:
                check(base_sd, "revert")

            a = time.perf_counter()
            load_checkpoint_weight_patches(model, sparse_patches)
            out["vllm_patches"].append(time.perf_counter() - a)
            if rep == 0:
                check(target_sd, "vllm patches")
            undo()

            a = time.perf_counter()
            model.load_weights(iter(dense))
            out["dense_reload"].append(time.perf_counter() - a)
            if rep == 0:
                check(target_sd, "dense reload")
            undo()
        check(base_sd, "end")
    st.staged["bench"] = staged  # for the engine-level pause measured by the driver
    return {"times": out, "stage_s": stage_once, "stage_timings": staged.timings,
            "changed": staged.changed, "numel": delta.header.numel, "patches": len(staged.patches),
            "delta_bytes": Path(delta_path).stat().st_size}


def changed_state(base: dict, fraction: float, seed: int) -> dict:
    """``base`` with low mantissa bits flipped in ``fraction`` of all elements (training-like)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    new = {}
    for n, t in base.items():
        bits = t.reshape(-1).view(torch.int16).clone()
        mask = torch.rand(bits.numel(), generator=g) < fraction
        flips = torch.randint(1, 4, (int(mask.sum()),), generator=g, dtype=torch.int16)
        bits[mask] ^= flips
        new[n] = bits.view(torch.bfloat16).view(t.shape)
    return new


def make_delta(model_dir: Path, out: Path, fraction: float, seed: int) -> dict:
    """A delta taking the checkpoint to :func:`changed_state` of it."""
    from shared.checkpoint import load_state
    from shared.codec import encode_delta
    from shared.digest import commitment, state_digest
    from shared.fingerprint import state_fingerprint_of

    base = load_state(model_dir)
    new = changed_state(base, fraction, seed)
    c0 = commitment("", state_fingerprint_of(base))
    data = encode_delta(base, new, version=1, base_version=0, base_commitment=c0)
    out.write_bytes(data)
    return {"base_commitment": c0, "base_state_digest": state_digest(base)}


def server_pauses(model_dir: Path, tmp: Path, versions: int, fraction: float) -> dict:
    """The same kind of delta through a real server (``python -m rollout_space``): the pause and
    the other steps each ``POST /update`` reports, one per published version."""
    import httpx
    import torch

    from shared.checkpoint import load_state
    from shared.publisher import DeltaPublisher
    from trainer_space.replica_process import Replica

    state = load_state(model_dir)
    store = tmp / "bucket"
    pub = DeltaPublisher(state, str(store), external_base=str(model_dir))
    t0 = time.perf_counter()
    server = Replica(model_dir, store, log_path=tmp / "server.log",
                     extra=["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes",
                            str(256 << 20), "--poll-s", "0", "--map-cache", str(tmp / "maps")],
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    url = server.url
    try:
        server.wait_ready(600)
        startup = time.perf_counter() - t0
        g = torch.Generator().manual_seed(1)
        steps = []
        for _ in range(versions):
            for t in state.values():
                bits = t.view(-1).view(torch.int16)
                mask = torch.rand(bits.numel(), generator=g) < fraction
                bits[mask] ^= 1
            report = pub.publish()
            pub.flush()
            r = httpx.post(url + "/update", json={"version": report.version}, timeout=300).json()
            assert r["version"] == report.version and r["state_digest"] == report.state_digest, r
            steps += r["steps"]
        digest = httpx.get(url + "/weights/digest", timeout=300).json()
        assert digest["state_digest"] == pub.state_digest, digest
    finally:
        server.stop()
        pub.close()
    keys = ("download_s", "stage_s", "drain_s", "pause_s", "write_s", "audit_s")
    return {"startup_s": startup, "versions": versions, "steps": steps,
            "median_s": {k: statistics.median(s[k] for s in steps) for k in keys},
            "delta_bytes_median": statistics.median(s["bytes"] for s in steps)}


def main() -> None:
    from bench.common import add_model_args, environment

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="existing model folder (default: build a Qwen3 of the given size)")
    add_model_args(ap)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--server-versions", type=int, default=5,
                    help="versions to push through a real server afterwards (0: skip)")
    ap.add_argument("--out", default=str(RESULTS / "apply_vllm.json"))
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-apply-vllm-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
    if a.model:
        model_dir = Path(a.model)
    else:
        from shared.tiny_model import build_tiny_model

        model_dir = build_tiny_model(tmp / "model", hidden=a.hidden, layers=a.layers, heads=a.heads,
                                     kv_heads=a.kv_heads, head_dim=64, intermediate=a.intermediate)

    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), enforce_eager=True, dtype="bfloat16", max_model_len=512,
              kv_cache_memory_bytes=256 << 20, worker_extension_cls="rollout_space.worker.DeltaWorkerExtension")
    engine_s = time.perf_counter() - t0
    init = json.loads(llm.collective_rpc("deltasync_init", args=(json.dumps(
        {"model_dir": str(model_dir), "map_cache": str(tmp / "maps")}),))[0])
    assert init["ok"], init
    info = make_delta(model_dir, tmp / "delta.safetensors", a.fraction, seed=0)
    adopt = json.loads(llm.collective_rpc("deltasync_adopt", args=(json.dumps(
        {"version": 0, "commitment": info["base_commitment"], "state_digest": info["base_state_digest"]}),))[0])
    assert adopt["ok"], adopt

    r = llm.collective_rpc(_worker_bench, args=(str(tmp / "delta.safetensors"), a.reps))[0]
    # the pause as the server takes it: worker call + prefix-cache reset, from the driver
    pause_rpc = []
    for _ in range(a.reps):
        t = time.perf_counter()
        res = json.loads(llm.collective_rpc("deltasync_write", args=("bench",))[0])
        llm.reset_prefix_cache()
        pause_rpc.append(time.perf_counter() - t)
        assert res["ok"], res
        assert json.loads(llm.collective_rpc("deltasync_revert", args=("bench",))[0])["ok"]

    med = {k: statistics.median(v) for k, v in r["times"].items()}
    med["pause_rpc"] = statistics.median(pause_rpc)
    floor = med["floor"]
    rows = [("deltasync pause: write (index_copy_ of staged bits)", "pause_write"),
            ("deltasync pause: worker call + prefix-cache reset", "pause_rpc"),
            ("floor: bare index_copy_, same positions", "floor"),
            ("dense reload through load_weights", "dense_reload"),
            ("vLLM load_checkpoint_weight_patches", "vllm_patches")]
    print(f"\nmodel {init['tensors']} tensors, {r['numel'] / 1e6:.1f}M params; changed {r['changed']:,} "
          f"({r['changed'] / r['numel']:.2%}); delta {r['delta_bytes'] / 1e6:.2f} MB; "
          f"{a.reps} reps, medians")
    print(f"{'method':<58}{'ms':>10}{'x floor':>10}")
    for label, key in rows:
        print(f"{label:<58}{med[key] * 1e3:>10.2f}{med[key] / floor:>10.2f}")
    print(f"{'staging while serving (decode+gather+predict), once':<58}{r['stage_s'] * 1e3:>10.2f}")
    srv = None
    if a.server_versions:
        del llm  # free the in-process engine before starting the server's
        srv = server_pauses(model_dir, tmp, a.server_versions, a.fraction)
        m = srv["median_s"]
        print(f"{'real server, POST /update (median of ' + str(srv['versions']) + ' versions)':<58}")
        for k in ("download_s", "stage_s", "drain_s", "pause_s", "write_s", "audit_s"):
            print(f"  {k[:-2]:<56}{m[k] * 1e3:>10.2f}{m[k] / floor:>10.2f}")
        print(f"  {'server start-up to healthy (s)':<56}{srv['startup_s']:>10.1f}")
    ok = med["pause_write"] <= 1.5 * floor and med["pause_write"] < min(med["dense_reload"],
                                                                          med["vllm_patches"])
    print(f"target (pause <= 1.5x floor and below both others): {'met' if ok else 'NOT met'}")
    result = {"model_params": r["numel"], "changed": r["changed"], "fraction": r["changed"] / r["numel"],
              "delta_bytes": r["delta_bytes"], "reps": a.reps, "median_s": med,
              "x_floor": {k: v / floor for k, v in med.items()}, "samples_s": r["times"] | {"pause_rpc": pause_rpc},
              "stage_s": r["stage_s"], "stage_timings": r["stage_timings"], "engine_start_s": engine_s,
              "map": {k: init[k] for k in ("tensors", "runs", "map_build_s", "map_built")},
              "target_met": ok, "server": srv, "environment": environment(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
