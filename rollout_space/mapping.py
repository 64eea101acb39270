"""Exact maps from checkpoint coordinates to a live vLLM model's parameters, found by probing.

vLLM fuses q/k/v and gate/up, pads the vocabulary and shards under tensor parallelism, so the
element at flat index ``i`` of checkpoint tensor ``name`` lives somewhere else in the engine. No
per-model table is needed to find out where: we ask the model's own ``load_weights``.

1. Fill every floating-point parameter with a sentinel (-1.0).
2. For each checkpoint tensor, load probe tensors whose element ``i`` holds byte ``b`` of ``i``
   plus one (1..256 are exact in bf16 and fp16), one probe per index byte.
3. Read back the non-sentinel elements (only in parameters the loader copied into, found by
   watching ``Tensor.copy_``; all parameters if none was seen): their values spell the checkpoint
   index that landed there. Values outside 1..256 are the loader's own writes (the embedding
   loader zero-fills padding rows) and belong to no checkpoint element.
4. Compress into runs ``(hf_start, length) -> (param, param_start)``, check there is no overlap
   in the engine, no checkpoint element landing twice, and (on a single rank) no gap.

Probing overwrites the weights, so it runs once per architecture, configuration and rank; the
result is cached as JSON and the real weights are loaded afterwards. A checkpoint tensor the
loader writes nowhere (a tied ``lm_head.weight``) is listed as ``ignored``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import torch
from pydantic import BaseModel

from shared.digest import SAFETENSORS_DTYPES, TORCH_DTYPES
from shared.fingerprint import Fingerprint, runs_fingerprint, tensor_fingerprint

SENTINEL = -1.0
MAP_FORMAT = 1


class MapError(RuntimeError):
    """The model's loader does something the probe method cannot express exactly."""


class ParamSpec(BaseModel):
    name: str
    dtype: str  # safetensors dtype string
    shape: list[int]


class TensorMap(BaseModel):
    """Where one checkpoint tensor's elements live on this rank, as runs sorted by hf_start."""

    dtype: str
    shape: list[int]
    hf_start: list[int] = []
    length: list[int] = []
    param: list[int] = []  # index into EngineMap.params
    param_start: list[int] = []

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def covered(self) -> int:
        return sum(self.length)


class EngineMap(BaseModel):
    format: int = MAP_FORMAT
    key: str
    rank: int = 0
    world: int = 1
    params: list[ParamSpec]
    tensors: dict[str, TensorMap]
    ignored: list[str] = []  # checkpoint tensors the loader writes nowhere on this rank
    build_s: float = 0.0

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(self.model_dump_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> EngineMap:
        return cls.model_validate_json(Path(path).read_text())

    @property
    def runs(self) -> int:
        return sum(len(t.hf_start) for t in self.tensors.values())


# --------------------------------------------------------------------------- checkpoint specs


def checkpoint_specs(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
    """Names, safetensors dtypes and shapes of a checkpoint's tensors, from the file headers."""
    import struct

    specs: dict[str, tuple[str, list[int]]] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                specs[name] = (info["dtype"], list(info["shape"]))
    return dict(sorted(specs.items()))


def float_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's floating-point parameters (tied ones once), in registration order."""
    return [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    return [ParamSpec(name=n, dtype=SAFETENSORS_DTYPES[p.dtype], shape=list(p.shape))
            for n, p in float_params(model)]


def map_key(specs: Mapping[str, tuple[str, list[int]]], params: list[ParamSpec], *,
            config: Mapping, rank: int, world: int, engine: str) -> str:
    """What a map depends on: architecture and config, checkpoint layout, engine layout, rank."""
    doc = {"format": MAP_FORMAT, "engine": engine, "rank": rank, "world": world, "config": config,
           "specs": specs, "params": [p.model_dump() for p in params]}
    return blake3.blake3(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


# --------------------------------------------------------------------------- probing


@dataclass
class _Landing:
    param: int
    positions: torch.Tensor  # int64 flat positions in the parameter holding probe values
    written: torch.Tensor  # every flat position the load changed (to restore the sentinel)


class _CopyWatch:
    """Record which storages ``Tensor.copy_`` writes into while active."""

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self._orig = torch.Tensor.copy_

    def __enter__(self) -> _CopyWatch:
        orig, storages = self._orig, self.storages

        def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            storages.add(dst.untyped_storage().data_ptr())
            return orig(dst, src, non_blocking)

        torch.Tensor.copy_ = copy_
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.copy_ = self._orig


def _probe_values(numel: int, byte: int, dtype: torch.dtype) -> torch.Tensor:
    idx = torch.arange(numel, dtype=torch.int64)
    return (((idx >> (8 * byte)) & 255) + 1).to(dtype)


def _index_bytes(numel: int) -> int:
    return max(1, math.ceil(max(numel - 1, 1).bit_length() / 8))


def _runs(hf_idx: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compress (checkpoint index -> parameter position) pairs sorted by position into runs."""
    if hf_idx.size == 0:
        return (np.empty(0, np.int64),) * 3
    brk = np.flatnonzero((np.diff(pos) != 1) | (np.diff(hf_idx) != 1)) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [hf_idx.size]])
    return hf_idx[starts], ends - starts, pos[starts]


def build_map(model: torch.nn.Module, specs: Mapping[str, tuple[str, list[int]]], *,
              key: str, rank: int = 0, world: int = 1) -> EngineMap:
    """Probe ``model.load_weights`` for every checkpoint tensor. Destroys the weights."""
    import time

    t0 = time.perf_counter()
    params = float_params(model)
    flats = [p.data.view(-1) for _, p in params]
    by_storage = {p.data.untyped_storage().data_ptr(): i for i, (_, p) in enumerate(params)}
    for name, p in params:
        if p.numel() == 0:
            raise MapError(f"{name} is empty: the engine computes from a packed copy, so in-place "
                           "updates would change nothing (see rollout_space.cpu_weights)")
    with torch.no_grad():
        for f in flats:
            f.fill_(SENTINEL)
        tensors: dict[str, TensorMap] = {}
        ignored: list[str] = []
        for name, (dtype_s, shape) in specs.items():
            dtype = TORCH_DTYPES.get(dtype_s)
            if dtype is None or not dtype.is_floating_point:
                ignored.append(name)
                continue
            tmap = _probe_tensor(model, name, dtype, shape, flats, by_storage)
            if tmap is None:
                ignored.append(name)
                continue
            tmap.dtype = dtype_s
            if world == 1 and tmap.covered != tmap.numel:
                raise MapError(f"{name}: only {tmap.covered} of {tmap.numel} elements land in the engine")
            tensors[name] = tmap
    _check_engine_overlap(tensors, [p.name for p in param_specs(model)])
    return EngineMap(key=key, rank=rank, world=world, params=param_specs(model), tensors=tensors,
                     ignored=ignored, build_s=time.perf_counter() - t0)


def _probe_tensor(model: torch.nn.Module, name: str, dtype: torch.dtype, shape: list[int],
                  flats: list[torch.Tensor], by_storage: dict[int, int]) -> TensorMap | None:
    numel = math.prod(shape)
    landings: list[_Landing] = []
    hf_parts: list[list[torch.Tensor]] = []
    for byte in range(_index_bytes(numel)):
        probe = _probe_values(numel, byte, dtype).view(shape)
        with _CopyWatch() as watch:
            model.load_weights([(name, probe)])
        if byte == 0:
            candidates = sorted({by_storage[s] for s in watch.storages if s in by_storage})
            for i in candidates or range(len(flats)):
                written = torch.nonzero(flats[i] != SENTINEL).view(-1)
                if written.numel():
                    vals = flats[i][written].float()
                    ok = (vals >= 1) & (vals <= 256) & (vals == vals.round())
                    landings.append(_Landing(i, written[ok], written))
            if not landings and candidates:  # the copies went elsewhere: look everywhere
                for i in range(len(flats)):
                    written = torch.nonzero(flats[i] != SENTINEL).view(-1)
                    if written.numel():
                        vals = flats[i][written].float()
                        ok = (vals >= 1) & (vals <= 256) & (vals == vals.round())
                        landings.append(_Landing(i, written[ok], written))
            hf_parts = [[] for _ in landings]
        for k, land in enumerate(landings):
            vals = flats[land.param][land.positions].float()
            if byte and not bool(((vals >= 1) & (vals <= 256)).all()):
                raise MapError(f"{name}: probe byte {byte} did not land where byte 0 did")
            hf_parts[k].append((vals.to(torch.int64) - 1) << (8 * byte))
    for land in landings:  # restore the sentinel for the next tensor
        flats[land.param][land.written] = SENTINEL
    if not any(land.positions.numel() for land in landings):
        return None
    starts, lengths, params, pstarts = [], [], [], []
    for land, parts in zip(landings, hf_parts):
        if not land.positions.numel():
            continue
        hf_idx = torch.stack(parts).sum(0).cpu().numpy()
        if hf_idx.max() >= numel:
            raise MapError(f"{name}: decoded index {hf_idx.max()} is outside the tensor")
        s, n, ps = _runs(hf_idx, land.positions.cpu().numpy())
        starts.append(s), lengths.append(n), pstarts.append(ps)
        params.append(np.full(s.size, land.param, np.int64))
    s, n, p, ps = (np.concatenate(a) for a in (starts, lengths, params, pstarts))
    order = np.argsort(s, kind="stable")
    s, n, p, ps = s[order], n[order], p[order], ps[order]
    if s.size > 1 and bool((s[1:] < s[:-1] + n[:-1]).any()):
        raise MapError(f"{name}: some elements land in two places on one rank")
    return TensorMap(dtype="", shape=list(shape), hf_start=s.tolist(), length=n.tolist(),
                     param=p.tolist(), param_start=ps.tolist())


def _check_engine_overlap(tensors: Mapping[str, TensorMap], param_names: list[str]) -> None:
    per_param: dict[int, list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        for p, ps, n in zip(t.param, t.param_start, t.length):
            per_param.setdefault(p, []).append((ps, n, name))
    for p, runs in per_param.items():
        runs.sort()
        for (a, n, na), (b, _, nb) in zip(runs, runs[1:]):
            if b < a + n:
                raise MapError(f"{param_names[p]}: {na} and {nb} both land at position {b}")


# --------------------------------------------------------------------------- runtime lookups


@dataclass
class Placement:
    """Part of a change that lands in one parameter."""

    param: int
    select: torch.Tensor | None  # which of the given positions (None: all of them, in order)
    dest: torch.Tensor  # flat positions in the parameter


def _single_run(t: TensorMap) -> tuple[int, int] | None:
    if len(t.hf_start) == 1 and t.hf_start[0] == 0 and t.length[0] == t.numel:
        return t.param[0], t.param_start[0]
    return None


class LiveMap:
    """An :class:`EngineMap` bound to the live parameters of a model."""

    def __init__(self, emap: EngineMap, model: torch.nn.Module):
        live = dict(float_params(model))
        missing = [p.name for p in emap.params if p.name not in live]
        if missing:
            raise MapError(f"map names parameters the model lacks: {missing[:3]}")
        self.map = emap
        self.params = [live[p.name] for p in emap.params]
        for spec, p in zip(emap.params, self.params):
            if list(p.shape) != spec.shape or SAFETENSORS_DTYPES[p.dtype] != spec.dtype:
                raise MapError(f"{spec.name}: model has {tuple(p.shape)}/{p.dtype}, map says "
                               f"{tuple(spec.shape)}/{spec.dtype}")
        self.flats = [p.data.view(-1) for p in self.params]
        self._arrays: dict[str, tuple[torch.Tensor, ...]] = {}
        self._tables: dict[str, list[tuple[int, np.ndarray]]] = {}
        # asked per touched tensor per version: answered once (the map does not change)
        self._single = {n: _single_run(t) for n, t in emap.tensors.items()}
        self._whole = {n for n, t in emap.tensors.items() if t.covered == t.numel}

    @property
    def names(self) -> list[str]:
        return list(self.map.tensors)

    def single_run(self, name: str) -> tuple[int, int] | None:
        """(param, offset) when the whole tensor is one contiguous run, else None."""
        return self._single[name]

    def locate(self, name: str, positions: torch.Tensor | None) -> list[Placement]:
        """Parameter positions of the given checkpoint positions (None: every element)."""
        t = self.map.tensors[name]
        one = self.single_run(name)
        if one is not None:
            p, off = one
            if positions is None:
                return [Placement(p, None, torch.arange(off, off + t.numel, dtype=torch.int64))]
            return [Placement(p, None, positions + off if off else positions)]
        if positions is None:
            positions = torch.arange(t.numel, dtype=torch.int64)
        if name not in self._arrays:
            self._arrays[name] = tuple(torch.tensor(a, dtype=torch.int64) for a in
                                       (t.hf_start, t.length, t.param, t.param_start))
        starts, lengths, params, pstarts = self._arrays[name]
        run = torch.searchsorted(starts, positions, right=True) - 1
        run_c = run.clamp(min=0)
        here = (run >= 0) & (positions < starts[run_c] + lengths[run_c])  # held on this rank
        out = []
        for p in torch.unique(params).tolist():
            sel = torch.nonzero(here & (params[run_c] == p)).view(-1)
            if sel.numel():
                r = run_c[sel]
                out.append(Placement(p, sel, positions[sel] - starts[r] + pstarts[r]))
        return out

    def whole(self, name: str) -> bool:
        """Whether this rank holds every element of ``name`` (always on one rank; under tensor
        parallelism, a tensor every rank holds a copy of, e.g. a norm)."""
        return name in self._whole

    def runs(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(checkpoint flat start, live elements in the checkpoint's dtype) per run this rank holds."""
        t = self.map.tensors[name]
        dtype = TORCH_DTYPES[t.dtype]
        for s, n, p, ps in zip(t.hf_start, t.length, t.param, t.param_start):
            run = self.flats[p][ps: ps + n]
            yield s, run if run.dtype == dtype else run.to(dtype)

    def run_tables(self, name: str) -> list[tuple[int, np.ndarray]]:
        """Per parameter that holds part of ``name`` on this rank: (param, rows of (checkpoint
        flat start, length, flat start in the parameter)), by checkpoint start."""
        if name not in self._tables:
            t = self.map.tensors[name]
            rows = np.array([t.hf_start, t.length, t.param_start], dtype=np.int64).T.reshape(-1, 3)
            params = np.array(t.param, dtype=np.int64)
            self._tables[name] = [(p, np.ascontiguousarray(rows[params == p])) for p in np.unique(params).tolist()]
        return self._tables[name]

    def fingerprint(self, name: str) -> Fingerprint:
        """The fingerprint of the elements this rank holds, at their checkpoint indices: the
        whole tensor's when it holds them all, else a partial sum that the other ranks' complete
        (one pass over a parameter's runs when it is in the checkpoint's dtype)."""
        if self.whole(name):
            return tensor_fingerprint(self.read(name))
        dtype = TORCH_DTYPES[self.map.tensors[name].dtype]
        total = Fingerprint()
        for p, rows in self.run_tables(name):
            flat = self.flats[p]
            if flat.dtype == dtype:
                total += runs_fingerprint(flat, rows)
            else:
                total += sum((tensor_fingerprint(flat[a:a + n].to(dtype), start=s) for s, n, a in rows.tolist()),
                             Fingerprint())
        return total

    def read(self, name: str) -> torch.Tensor:
        """The live tensor in checkpoint coordinates (a view when it is one run, else a copy)."""
        t = self.map.tensors[name]
        one = self.single_run(name)
        if one is not None:
            p, off = one
            out = self.flats[p][off: off + t.numel]
        else:
            if not self.whole(name):
                raise MapError(f"{name} is split across ranks; read its runs on every rank")
            out = torch.empty(t.numel, dtype=self.params[t.param[0]].dtype)
            for s, n, p, ps in zip(t.hf_start, t.length, t.param, t.param_start):
                out[s: s + n] = self.flats[p][ps: ps + n]
        dtype = TORCH_DTYPES[t.dtype]
        if out.dtype != dtype:
            out = out.to(dtype)
        return out.view(t.shape)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.map.tensors:
            yield name, self.read(name)
