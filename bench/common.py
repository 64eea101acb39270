"""Shared bits of the benchmarks: timing, the baselines, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued accelerator work, so a timing ends when the work does (no-op on CPU)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], reps: int = 5, device: torch.device | str | None = None) -> float:
    """Median wall time of ``fn``; with an accelerator ``device`` each call is synchronised."""
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_seconds(state: Mapping[str, torch.Tensor], reps: int = 5) -> float:
    """Time to copy every tensor once into preallocated buffers on its device: the memcpy floor."""
    bufs = {n: torch.empty_like(t) for n, t in state.items()}
    device = next(iter(state.values())).device if state else None

    def copy():
        for n, t in state.items():
            bufs[n].copy_(t)

    copy()
    return median_time(copy, reps, device)


_OR_WORDS = None  # compiled on first use: numba must not load before a vLLM engine starts


def read_seconds(*states: Mapping[str, torch.Tensor], reps: int = 5) -> float:
    """Time to read every tensor of ``states`` once (an OR of its 64-bit words, on the tensor
    threads): the least a compare of a snapshot with new weights costs. Where reads are no
    faster than copies (this machine), that is more than a memcpy of one of them."""
    global _OR_WORDS
    import numba
    import numpy as np

    from shared.changes import map_balanced

    if _OR_WORDS is None:
        def or_words(x):  # pragma: no cover - compiled by numba
            acc = np.uint64(0)
            for i in range(x.shape[0]):
                acc |= x[i]
            return acc

        _OR_WORDS = numba.njit(nogil=True)(or_words)
    arrays = []
    for state in states:
        for t in state.values():
            raw = t.detach().reshape(-1).view(torch.uint8).numpy()
            arrays.append(raw[: raw.shape[0] // 8 * 8].view(np.uint64))
    read = lambda: map_balanced(_OR_WORDS, arrays, [x.shape[0] for x in arrays])  # noqa: E731
    read()
    return median_time(read, reps)


def int32_bf16_bytes(positions: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> int:
    """Size of the TRL prototype's format (int32 indices + values) for the same change."""
    import safetensors.torch

    tensors = {}
    for name, pos in positions.items():
        if pos.numel():
            tensors[f"{name}.indices"] = pos.to(torch.int32)
            tensors[f"{name}.values"] = new[name].reshape(-1)[pos].contiguous()
    return len(safetensors.torch.save(tensors, metadata={"sparse": "true"})) if tensors else 0


def environment() -> dict:
    """Where a result was measured. ``cpu`` and ``vector`` are what numba's kernels were compiled
    for (LLVM's name of the host CPU and its vector extensions): the same fingerprint kernel took
    16.6 ms for 61M elements one day and 115 ms another on this development VM, and only AVX-512
    has the vector 64-bit multiply it is made of, so results of different days need the CPU beside
    them to be compared."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "platform": platform.platform(),
            "processor": platform.processor(), "cpus": os.cpu_count(), "cpu": llvm.get_host_cpu_name(),
            "vector": sorted(k for k in features if features[k] and k.startswith(("avx", "fma", "sse4")))}


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload | {"environment": environment()}, indent=1))
    return path


def add_model_args(ap) -> None:
    """The size of the locally built Qwen3 a benchmark runs on (defaults: the 61M model)."""
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
