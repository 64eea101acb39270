"""Codec benchmark: bytes, encode throughput and apply time of our format next to the dense
checkpoint, the int32+bf16 format and memcpy, all measured in the same process.

Cases: real-gradient trajectories (next-token loss on a locally built Qwen3) and AdamW
trajectories with random gradients on LLM-like weights, at RL learning rates. Each case runs in
a fresh process so its peak memory is its own. Medians over the steps after Adam's first.

The encode speed that matters is the time ``DeltaPublisher.publish()`` holds the training loop,
measured for a bf16 model and, separately, for fp32 master weights (the cast to bf16 included),
each against a memcpy of the bf16 model's bytes, and beside them the read floor: reading the
snapshot and the new weights once each, which any compare must do ("memcpy/read": the best
``memcpy/publish`` this machine allows). The encoder thread's time after it (digests
of the touched tensors, fingerprints in O(changes), entropy coding, the delta file) is reported
beside it: it runs while the next step trains, but it is CPU the trainer's host spends per version.
"same, digests at anchors" is that for ``DeltaPublisher(digests="anchors")``, which hashes no
tensor whole for a delta (its work is O(changes)). "same, copy_from=0" is ``publish()`` of
publishers that copy every tensor (``DeltaPublisher(copy_from=0)``: a second snapshot in host
memory) and find every change in the encoder thread; the default copies only busy tensors.
The read floor does not bind those: a copy reads the new weights once and writes the snapshot.

Cases run with torch's OpenMP workers spinning as briefly as in the trainer Space
(:mod:`shared.openmp`), unless ``--libgomp-spin``: then, as in a trainer that leaves libgomp's
default, they spin through the start of every ``publish()``.

    python -m bench.codec [--quick] [--large] [--only 26M,79M] [--libgomp-spin]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass

import safetensors.torch
import torch
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from bench.common import RESULTS, int32_bf16_bytes, median_time, memcpy_seconds, read_seconds, write_json
from shared.openmp import bound_openmp_spin


@dataclass
class Case:
    name: str
    kind: str  # "real" | "adamw"
    hidden: int
    layers: int
    intermediate: int
    lr: float
    steps: int = 6


def build_model(case: Case):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=case.hidden, intermediate_size=case.intermediate,
                      num_hidden_layers=case.layers, num_attention_heads=case.hidden // 64,
                      num_key_value_heads=max(1, case.hidden // 128), head_dim=64,
                      tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.05 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    return model


def trajectory(case: Case, model):
    """Yield after each optimizer step (fp32 master weights, AdamW)."""
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    if case.kind == "real":
        from shared.tiny_model import CORPUS

        text = torch.tensor(list(" ".join(CORPUS * 8).encode()), dtype=torch.long) % 512
    for _ in range(case.steps):
        if case.kind == "real":
            starts = torch.randint(0, len(text) - 65, (4,), generator=g)
            ids = torch.stack([text[s:s + 64] for s in starts])
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def run_case(case: Case) -> dict:
    from shared.apply import prepare, write_all
    from shared.chain import AnchorPolicy
    from shared.checkpoint import module_state
    from shared.codec import DeltaFile, build_delta, encode_state, encode_tensor, save_delta
    from shared.digest import tensor_digest
    from shared.publisher import DeltaPublisher

    torch.set_num_threads(torch.get_num_threads())
    model = build_model(case)
    live = module_state(model)
    snap = {n: t.to(torch.bfloat16) for n, t in live.items()}
    # what a trainer publishes: a bf16 model (its tensors updated in place each step), and fp32
    # master weights cast by the publisher; anchors only at genesis, so every step times a delta
    bf16_model = {n: t.clone() for n, t in snap.items()}
    stores = [tempfile.TemporaryDirectory(prefix="bench-codec-") for _ in range(5)]
    publishers = {"bf16": DeltaPublisher(bf16_model, stores[0].name, keep_anchors=10**6,
                                         policy=AnchorPolicy(catchup_fraction=1e9)),
                  "fp32": DeltaPublisher(live, stores[1].name, keep_anchors=10**6,
                                         policy=AnchorPolicy(catchup_fraction=1e9)),
                  # blake3 digests only at anchors: the encoder thread's work is O(changes)
                  "bf16_anchors": DeltaPublisher(bf16_model, stores[2].name, keep_anchors=10**6, digests="anchors",
                                                 policy=AnchorPolicy(catchup_fraction=1e9)),
                  # every tensor copied at publish(), every change found in the encoder thread
                  "bf16_copy": DeltaPublisher(bf16_model, stores[3].name, keep_anchors=10**6, copy_from=0.0,
                                              policy=AnchorPolicy(catchup_fraction=1e9)),
                  "fp32_copy": DeltaPublisher(live, stores[4].name, keep_anchors=10**6, copy_from=0.0,
                                              policy=AnchorPolicy(catchup_fraction=1e9))}
    numel = sum(t.numel() for t in snap.values())
    dense = sum(t.numel() * t.element_size() for t in snap.values())
    dense_file = safetensors.torch.save(snap)
    steps = []
    for step, _ in enumerate(tqdm(trajectory(case, model), total=case.steps, desc=case.name, leave=False)):
        new = {n: t.detach().to(torch.bfloat16) for n, t in live.items()}
        base = {n: t.clone() for n, t in snap.items()}
        for n, t in new.items():
            bf16_model[n].copy_(t)
        hold, behind = {}, {}  # publish() holding the loop; the encoder thread after it
        for kind, pub in publishers.items():
            t0 = time.perf_counter()
            published = pub.publish()
            hold[kind] = time.perf_counter() - t0
            published.wait(600)  # its upload must not run into the timings below
            assert published.kind == "delta", published.kind
            behind[kind] = published.encoder_s
        t0 = time.perf_counter()
        encoded = {n: encode_tensor(n, snap[n], new[n], update=True, digest="0" * 64) for n in new}
        encode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        digests = {n: tensor_digest(t) for n, t in new.items()}
        digest_s = time.perf_counter() - t0
        for n, e in encoded.items():
            e.entry.digest = digests[n]
        header, tensors = build_delta(encoded, version=step + 1, base_version=step, base_commitment="")
        data = save_delta(header, tensors)
        changed = header.changed
        # baselines on the same change
        positions = {n: torch.nonzero(base[n].reshape(-1).view(torch.int16)
                                      != new[n].reshape(-1).view(torch.int16)).reshape(-1) for n in new}
        assert sum(p.numel() for p in positions.values()) == changed
        trl_bytes = int32_bf16_bytes(positions, new)
        copy_s = memcpy_seconds(new)
        # the least a compare costs: reading the snapshot and the new weights once each
        read_bf16_s, read_fp32_s = read_seconds(base, new), read_seconds(base, live)
        # the compact coding (positions per exponent class), same change
        t0 = time.perf_counter()
        compact_enc = encode_state(base, new, compact=True, digests=digests)
        compact_encode_s = time.perf_counter() - t0
        compact = save_delta(*build_delta(compact_enc, version=step + 1, base_version=step, base_commitment=""))
        # apply: decode + gather + scatter, vs loading the dense checkpoint, vs bare index_copy_
        target = {n: t.clone() for n, t in base.items()}

        def apply_timed(blob: bytes) -> float:
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                patches = prepare(DeltaFile.from_bytes(blob), target)
                write_all(patches)
                times.append(time.perf_counter() - t0)
                assert all(torch.equal(target[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
                for p in patches:
                    p.revert()
            return statistics.median(times[1:])  # the first call also compiles/loads kernels

        apply_s, compact_apply_s = apply_timed(data), apply_timed(compact)
        dense_target = {n: t.clone() for n, t in base.items()}

        def dense_load():
            loaded = safetensors.torch.load(dense_file)
            for n, t in loaded.items():
                dense_target[n].copy_(t)

        dense_s = median_time(dense_load, 3)
        flat = {n: target[n].view(-1).view(torch.int16) for n in new}
        vals = {n: new[n].reshape(-1).view(torch.int16)[p] for n, p in positions.items()}
        floor_s = median_time(lambda: [flat[n].index_copy_(0, p, vals[n]) for n, p in positions.items()], 5)
        assert published.state_fingerprint == header.state_fingerprint  # the publishers' version is this one
        if step == 0:
            continue  # Adam's first step moves every weight by exactly lr: not representative
        steps.append({
            "changed_fraction": changed / numel, "ours_bytes": len(data), "int32_bf16_bytes": trl_bytes,
            "dense_bytes": dense, "ours_B_per_change": len(data) / max(changed, 1),
            "int32_bf16_B_per_change": trl_bytes / max(changed, 1),
            "encode_GBps": dense / encode_s / 1e9, "memcpy_GBps": dense / copy_s / 1e9,
            "encode_vs_memcpy": copy_s / encode_s, "digest_GBps": dense / digest_s / 1e9,
            "publish_bf16_s": hold["bf16"], "publish_fp32_s": hold["fp32"], "memcpy_s": copy_s,
            "publish_bf16_vs_memcpy": copy_s / hold["bf16"], "publish_fp32_vs_memcpy": copy_s / hold["fp32"],
            "publish_bf16_copy_s": hold["bf16_copy"], "publish_fp32_copy_s": hold["fp32_copy"],
            "publish_bf16_copy_vs_memcpy": copy_s / hold["bf16_copy"],
            "publish_fp32_copy_vs_memcpy": copy_s / hold["fp32_copy"],
            "read_bf16_s": read_bf16_s, "read_fp32_s": read_fp32_s,
            "read_bf16_vs_memcpy": copy_s / read_bf16_s, "read_fp32_vs_memcpy": copy_s / read_fp32_s,
            "encoder_bf16_s": behind["bf16"], "encoder_fp32_s": behind["fp32"],
            "encoder_bf16_anchors_s": behind["bf16_anchors"], "encoder_bf16_copy_s": behind["bf16_copy"],
            "apply_s": apply_s, "dense_load_s": dense_s, "index_copy_s": floor_s,
            "compact_B_per_change": len(compact) / max(changed, 1),
            "compact_encode_GBps": dense / compact_encode_s / 1e9, "compact_apply_s": compact_apply_s,
        })
    for pub in publishers.values():
        pub.close()
    for store in stores:
        store.cleanup()
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    return {"case": case.name, "kind": case.kind, "params": numel, "lr": case.lr,
            "steps": len(steps), "median": med, "per_step": steps,
            "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def cases(quick: bool, large: bool) -> list[Case]:
    small = dict(hidden=512, layers=8, intermediate=1536)  # ~26M
    mid = dict(hidden=768, layers=12, intermediate=2048)  # ~79M
    big = dict(hidden=1024, layers=16, intermediate=3072)  # ~202M
    if quick:
        return [Case("real-26M-lr3e-7", "real", lr=3e-7, steps=3, **small)]
    out = [Case("real-26M-lr3e-7", "real", lr=3e-7, **small),  # ~1% change
           Case("real-26M-lr1e-6", "real", lr=1e-6, **small),
           Case("real-26M-lr3e-6", "real", lr=3e-6, **small),
           Case("real-79M-lr3e-7", "real", lr=3e-7, steps=4, **mid),  # ~1% change
           Case("real-79M-lr1e-6", "real", lr=1e-6, steps=4, **mid),
           Case("adamw-26M-lr1e-6", "adamw", lr=1e-6, **small),
           Case("adamw-26M-lr3e-6", "adamw", lr=3e-6, **small),
           Case("adamw-202M-lr5e-7", "adamw", lr=5e-7, steps=4, **big),  # ~1% change
           Case("adamw-202M-lr1e-6", "adamw", lr=1e-6, steps=4, **big),
           Case("adamw-202M-lr3e-6", "adamw", lr=3e-6, steps=4, **big)]
    if large:
        out.append(Case("adamw-805M-lr1e-6", "adamw", hidden=2048, layers=16, intermediate=6144,
                        lr=1e-6, steps=3))
    return out


def report(results: list[dict]) -> None:
    console = Console(width=240)
    size = Table(title="payload: bytes per changed element (medians per step, after Adam's first)")
    for col in ["case", "params", "changed", "dense MB", "int32+bf16 B/chg", "deltasync B/chg",
                "vs int32+bf16", "vs dense", "compact B/chg", "compact vs int32+bf16"]:
        size.add_column(col, justify="right")
    speed = Table(title="speed: encode and publish() vs memcpy, apply (decode + scatter) vs dense load and "
                        "index_copy_")
    for col in ["case", "encode GB/s", "memcpy GB/s", "encode/memcpy", "publish bf16 ms", "publish fp32 ms",
                "encoder thread bf16 ms", "same, digests at anchors", "memcpy/publish bf16", "memcpy/publish fp32",
                "same, copy_from=0: bf16", "fp32",
                "memcpy/read bf16", "memcpy/read fp32",
                "digest GB/s", "apply ms",
                "dense load ms", "index_copy_ ms", "apply/index_copy_", "apply/dense",
                "compact encode GB/s", "compact apply ms", "peak RSS MB"]:
        speed.add_column(col, justify="right")
    for r in results:
        m = r["median"]
        size.add_row(r["case"], f"{r['params'] / 1e6:.0f}M", f"{m['changed_fraction']:.2%}",
                     f"{m['dense_bytes'] / 1e6:.0f}", f"{m['int32_bf16_B_per_change']:.2f}",
                     f"{m['ours_B_per_change']:.3f}", f"{m['int32_bf16_bytes'] / m['ours_bytes']:.2f}x",
                     f"{m['dense_bytes'] / m['ours_bytes']:.0f}x", f"{m['compact_B_per_change']:.3f}",
                     f"{m['int32_bf16_B_per_change'] / m['compact_B_per_change']:.2f}x")
        speed.add_row(r["case"], f"{m['encode_GBps']:.2f}", f"{m['memcpy_GBps']:.2f}",
                      f"{m['encode_vs_memcpy']:.2f}x", f"{m['publish_bf16_s'] * 1e3:.1f}",
                      f"{m['publish_fp32_s'] * 1e3:.1f}", f"{m['encoder_bf16_s'] * 1e3:.1f}",
                      f"{m['encoder_bf16_anchors_s'] * 1e3:.1f}",
                      f"{m['publish_bf16_vs_memcpy']:.2f}x",
                      f"{m['publish_fp32_vs_memcpy']:.2f}x", f"{m['publish_bf16_copy_vs_memcpy']:.2f}x",
                      f"{m['publish_fp32_copy_vs_memcpy']:.2f}x", f"{m['read_bf16_vs_memcpy']:.2f}x",
                      f"{m['read_fp32_vs_memcpy']:.2f}x", f"{m['digest_GBps']:.1f}",
                      f"{m['apply_s'] * 1e3:.1f}", f"{m['dense_load_s'] * 1e3:.1f}",
                      f"{m['index_copy_s'] * 1e3:.1f}", f"{m['apply_s'] / m['index_copy_s']:.1f}x",
                      f"{m['apply_s'] / m['dense_load_s']:.2f}x", f"{m['compact_encode_GBps']:.2f}",
                      f"{m['compact_apply_s'] * 1e3:.1f}", f"{r['peak_rss_MB']:.0f}")
    console.print(size)
    console.print(speed)


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in results]
    ours = [r["median"]["ours_B_per_change"] for r in results]
    trl = [r["median"]["int32_bf16_B_per_change"] for r in results]
    compact = [r["median"]["compact_B_per_change"] for r in results]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([i - 0.27 for i in x], trl, 0.27, label="int32 + bf16")
    ax.bar(list(x), ours, 0.27, label="deltasync")
    ax.bar([i + 0.27 for i in x], compact, 0.27, label="deltasync --compact")
    ax.axhline(1.35, color="k", ls="--", lw=1, label="target 1.35 B")
    ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("bytes per changed element")
    ax.set_title("Delta payload per changed bf16 element (median over steps)")
    ax.legend(loc="upper center", ncol=4)
    ax.set_ylim(0, 7)
    fig.tight_layout()
    fig.savefig(RESULTS / "codec.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one small case (a smoke test)")
    ap.add_argument("--large", action="store_true", help="also an ~800M-parameter case")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the cases whose names hold one")
    ap.add_argument("--libgomp-spin", action="store_true",
                    help="leave torch's OpenMP workers at libgomp's default spin, as a trainer that does not "
                         "import trainer_space first (see shared.openmp); by default the cases run as the trainer "
                         "Space does")
    a = ap.parse_args()
    if not a.libgomp_spin:
        bound_openmp_spin()  # for the case processes, which load torch after this
    spin = os.environ.get("GOMP_SPINCOUNT", "libgomp default")
    results = []
    wanted = [w for w in a.only.split(",") if w]
    for case in cases(a.quick, a.large):
        if wanted and not any(w in case.name for w in wanted):
            continue
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:  # peak RSS per case
            results.append({**pool.submit(run_case, case).result(), "gomp_spincount": spin})
    report(results)
    print(f"torch's OpenMP workers spin: GOMP_SPINCOUNT={spin}")
    path = write_json("codec", {"results": results})
    plot(results)
    print(f"wrote {path} and {RESULTS / 'codec.png'}")


if __name__ == "__main__":
    main()
