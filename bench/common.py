"""Shared bits of the benchmarks: timing, the baselines, result files."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import safetensors.torch
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn: Callable[[], object], reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_seconds(state: Mapping[str, torch.Tensor], reps: int = 5) -> float:
    """Time to copy every tensor once into preallocated buffers: the machine's memcpy floor."""
    bufs = {n: torch.empty_like(t) for n, t in state.items()}

    def copy():
        for n, t in state.items():
            bufs[n].copy_(t)

    copy()
    return median_time(copy, reps)


def int32_bf16_bytes(positions: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> int:
    """Size of the TRL prototype's format (int32 indices + values) for the same change."""
    tensors = {}
    for name, pos in positions.items():
        if pos.numel():
            tensors[f"{name}.indices"] = pos.to(torch.int32)
            tensors[f"{name}.values"] = new[name].reshape(-1)[pos].contiguous()
    return len(safetensors.torch.save(tensors, metadata={"sparse": "true"})) if tensors else 0


def environment() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "processor": platform.processor()}


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload | {"environment": environment()}, indent=1))
    return path
