"""Linear tensor fingerprints (DESIGN.md, "Tensor fingerprint"): a second per-tensor hash that
can be updated in O(changed elements), summed over shards and computed on any device.

Definition, for a tensor of w-bit elements with flat C-order index i and bit pattern b_i::

    x_i    = (i * 2**w + b_i) mod 2**64
    mix(z) = splitmix64's finalizer (logical shifts, all mod 2**64)
    lane_k = sum over i of mix(x_i ^ K[k]) mod 2**64, k = 0..3
    hex    = the four lanes as 16 lowercase hex digits each (most significant digit first),
             lane 0 first: 64 characters, like a blake3 hex digest

Supported: every safetensors dtype the project stores (``shared.digest.SAFETENSORS_DTYPES``).
w = 8 (U8, I8, BOOL), 16 (BF16, F16, I16) and 32 (F32, I32) are exactly the definition above.
For w = 64 (F64, I64) the definition would lose the index (``i * 2**64`` is 0 mod 2**64, so
swapped elements would go unnoticed); such a tensor is fingerprinted as its little-endian
32-bit words instead: element i is word 2i (low half) and word 2i+1 (high half), w = 32. This
is an extension of DESIGN.md, not part of it. The index wraps above 2**(64-w) elements (2**32
for w = 32), far beyond any single tensor the project holds.

It detects corruption and bugs, not attackers: blake3 digests and commitments do that.

Two backends, bit for bit the same: numba on CPU (chunks on threads, the GIL released) and plain
torch int64 ops on any device (``>>`` on int64 is arithmetic in torch, so shifts are masked to be
logical; int64 multiplication and sums wrap mod 2**64 as required). Only the kernels differ:
input handling, chunking and the 64-bit rule are shared. numba is imported on first use (see
``shared/kernels.py``: importing it before a vLLM engine starts breaks the engine).
"""

from __future__ import annotations

import functools
import re
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

from . import buffers
from .digest import dtype_name, state_digest_from_entries

MASK64 = (1 << 64) - 1
_HEX64 = re.compile("[0-9a-f]{64}")
_LANES = struct.Struct(">4Q")  # a fingerprint's hex: its lanes as big-endian words
K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
WIDTHS = (8, 16, 32, 64)
# Elements per piece of work. numba: per thread task (big enough to amortise, small enough to
# balance). torch on a CPU: (4, chunk) int64 scratch that stays in cache and under torch's
# intra-op grain (32768), so no OpenMP fork/join per op (which cost 20x on a loaded 2-core
# machine; numba is the CPU's fast path anyway). torch elsewhere: few kernel launches, scratch
# bounded (~1.5 GiB).
CHUNK = {"numba": 1 << 22, "cpu": 1 << 12, "device": 1 << 24}
Backend = Literal["auto", "numba", "torch"]

_SIGNED = {8: torch.uint8, 16: torch.int16, 32: torch.int32}  # torch views of each width
_UNSIGNED_NP = {8: np.uint8, 16: np.uint16, 32: np.uint32}
_NP_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # numpy bits -> a view torch takes


@dataclass(frozen=True)
class Fingerprint:
    """Four uint64 lanes; adds and subtracts lane-wise mod 2**64, so shards and updates compose."""

    lanes: tuple[int, int, int, int] = (0, 0, 0, 0)

    def __post_init__(self) -> None:
        if len(self.lanes) != 4 or not all(isinstance(v, int) and 0 <= v <= MASK64 for v in self.lanes):
            raise ValueError(f"a fingerprint is four integers in [0, 2**64): {self.lanes!r}")

    def __add__(self, other: Fingerprint) -> Fingerprint:
        if not isinstance(other, Fingerprint):
            return NotImplemented
        return Fingerprint(tuple((a + b) & MASK64 for a, b in zip(self.lanes, other.lanes)))

    def __radd__(self, other: object) -> Fingerprint:
        """Lets ``sum(parts)`` start from its default 0."""
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented

    def __sub__(self, other: Fingerprint) -> Fingerprint:
        if not isinstance(other, Fingerprint):
            return NotImplemented
        return Fingerprint(tuple((a - b) & MASK64 for a, b in zip(self.lanes, other.lanes)))

    def __neg__(self) -> Fingerprint:
        return Fingerprint() - self

    def hex(self) -> str:
        return _LANES.pack(*self.lanes).hex()

    @classmethod
    def from_hex(cls, text: str) -> Fingerprint:
        # struct, not int() per lane: a publisher converts every touched tensor's each version
        if not isinstance(text, str) or not _HEX64.fullmatch(text):
            raise ValueError(f"a fingerprint is 64 lowercase hex digits: {text!r}")
        return cls(_LANES.unpack(bytes.fromhex(text)))

    def __str__(self) -> str:
        return self.hex()


ZERO = Fingerprint()


# --------------------------------------------------------------------------- shared input handling
def _words(x: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, int, int]:
    """Flat C-order integer view of the bits (no copy when contiguous) as words of width w,
    with how many words make one element (2 for 64-bit elements, 1 otherwise)."""
    if isinstance(x, np.ndarray):
        if x.dtype.itemsize not in _NP_SIGNED:
            raise ValueError(f"no fingerprint for {x.dtype.itemsize * 8}-bit elements ({x.dtype})")
        x = torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(_NP_SIGNED[x.dtype.itemsize]))
    elif x.dtype not in (torch.uint16, torch.uint32, torch.uint64):  # bit patterns, not a stored dtype
        dtype_name(x.dtype)  # refuses what safetensors cannot store
    width = x.element_size() * 8
    if width not in WIDTHS:
        raise ValueError(f"no fingerprint for {width}-bit elements ({x.dtype})")
    per = 2 if width == 64 else 1
    width = min(width, 32)
    # each torch call costs microseconds, and this runs once per touched tensor per version
    flat = x.detach() if x.requires_grad else x
    if flat.dim() != 1:
        flat = flat.reshape(-1)
    return (flat if flat.dtype == _SIGNED[width] else flat.view(_SIGNED[width])), width, per


def _word_indices(indices: torch.Tensor, per: int) -> torch.Tensor:
    """Element indices to word indices (64-bit elements: the low word at 2i, the high at 2i+1)."""
    if per == 1:
        return indices
    return (indices[:, None] * 2 + torch.arange(2, dtype=torch.int64, device=indices.device)).reshape(-1)


def _pick(backend: Backend, device: torch.device) -> str:
    if backend == "auto":
        return "numba" if device.type == "cpu" else "torch"
    if backend == "numba" and device.type != "cpu":
        raise ValueError(f"the numba backend runs on the CPU, not {device}")
    if backend not in ("numba", "torch"):
        raise ValueError(f"unknown backend {backend!r}")
    return backend


def _chunk(kind: str, device: torch.device) -> int:
    return CHUNK["numba"] if kind == "numba" else CHUNK["cpu" if device.type == "cpu" else "device"]


def _device(device: str | torch.device | None, fallback: torch.device) -> torch.device:
    d = torch.device(device) if device is not None else fallback
    if d.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {d} asked for, but torch sees no CUDA device")
    return d


def _pieces_of(runs: np.ndarray, chunk: int) -> np.ndarray:
    """Runs cut into pieces of at most ``chunk`` words, in order."""
    cuts = -(-runs[:, 1] // chunk)
    if not runs.size or cuts.max() <= 1:
        return runs
    row = np.repeat(np.arange(runs.shape[0]), cuts)
    k = np.arange(row.shape[0]) - np.repeat(np.cumsum(cuts) - cuts, cuts)  # piece k of its run
    step = k * chunk
    return np.stack([runs[row, 0] + step, np.minimum(chunk, runs[row, 1] - step), runs[row, 2] + step], axis=1)


def _groups(pieces: np.ndarray, size: int) -> list[tuple[int, int]]:
    """Consecutive pieces in groups of about ``size`` words each: ``(first, end)`` rows."""
    if not pieces.size:
        return []
    ends = np.cumsum(pieces[:, 1])
    cuts = np.searchsorted(ends, np.arange(size, int(ends[-1]), size), side="left") + 1
    edges = sorted({0, *cuts.tolist(), pieces.shape[0]})
    return list(zip(edges[:-1], edges[1:]))


# --------------------------------------------------------------------------- public API
def tensor_fingerprint(t: torch.Tensor, *, start: int = 0, device: str | torch.device | None = None,
                       backend: Backend = "auto", threads: bool = True, chunk: int | None = None) -> Fingerprint:
    """Fingerprint of ``t``'s elements at global flat indices ``start, start+1, ...``.

    ``start`` makes shards add up: the fingerprints of the pieces of a flat tensor, each with
    the global index of its first element, sum to the whole tensor's. ``device``: where the
    torch backend computes (default: where ``t`` is; chunks move there one at a time).
    ``backend="auto"`` takes numba for the CPU and torch elsewhere. ``threads=False`` keeps the
    numba chunks in the calling thread (for callers that parallelise across tensors). ``chunk``:
    elements per piece of work (default: :data:`CHUNK` for the backend and device).
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, not {start}")
    words, width, per = _words(t)
    dev = _device(device, words.device)
    kind = _pick(backend, dev)
    chunk = (chunk or _chunk(kind, dev)) * per
    if kind == "numba":
        return _numba_range(words, start * per, width, threads, chunk)
    return _torch_range(words, start * per, width, dev, chunk)


def runs_fingerprint(flat: torch.Tensor, runs: np.ndarray, *, device: str | torch.device | None = None,
                     backend: Backend = "auto", chunk: int | None = None) -> Fingerprint:
    """Fingerprint of runs of ``flat`` placed elsewhere: row ``(start, length, at)`` of ``runs``
    (int64, shape (R, 3)) is ``flat[at:at + length]`` at global flat indices ``start, start+1,
    ...``; the sum of :func:`tensor_fingerprint` of each run with its ``start``, in one pass. A
    rank holding a row-parallel shard holds a run per row, thousands per tensor: a call per run
    cost more than the hashing. Runs may come in any order; overlapping ones count twice."""
    words, width, per = _words(flat)
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if runs.size and (runs.min() < 0 or (runs[:, 2] + runs[:, 1]).max() > flat.numel()):
        raise ValueError(f"runs outside the {flat.numel()} elements given, or negative")
    dev = _device(device, words.device)
    kind = _pick(backend, dev)
    chunk = (chunk or _chunk(kind, dev)) * per
    pieces = _pieces_of(runs[runs[:, 1] > 0] * per, chunk)
    if kind == "numba":
        return _numba_runs(words, pieces, width, chunk)
    return _torch_runs(words, pieces, width, dev, chunk)


def fingerprint_delta(indices: torch.Tensor | np.ndarray, old_bits: torch.Tensor | np.ndarray,
                      new_bits: torch.Tensor | np.ndarray, width: int, *,
                      device: str | torch.device | None = None, backend: Backend = "auto",
                      chunk: int | None = None) -> Fingerprint:
    """What changing the elements at global flat ``indices`` from ``old_bits`` to ``new_bits``
    adds to a fingerprint: ``sum mix(x'_i ^ K) - mix(x_i ^ K)``, in O(len(indices)).

    ``old_bits``/``new_bits``: the elements (any dtype of ``width`` bits: bf16 values, int16 or
    uint16 bit patterns, ...), one per index. Unchanged positions may be included (they add 0);
    an index listed twice counts twice. 64-bit elements: indices of elements, not of their halves.
    """
    idx = torch.from_numpy(np.ascontiguousarray(indices)) if isinstance(indices, np.ndarray) else indices
    if idx.dim() != 1:
        idx = idx.reshape(-1)
    if idx.dtype != torch.int64:
        idx = idx.to(torch.int64)
    old, w_old, per = _words(old_bits)
    new, w_new, _ = _words(new_bits)
    if width not in WIDTHS or w_old != min(width, 32) or w_new != w_old:
        raise ValueError(f"bits of {old_bits.dtype}/{new_bits.dtype} are not {width}-bit elements")
    if not (idx.shape[0] * per == old.shape[0] == new.shape[0]):
        raise ValueError(f"{idx.shape[0]} indices for {old.shape[0] // per}/{new.shape[0] // per} elements")
    dev = _device(device, old.device)
    widx = _word_indices(idx, per)
    kind = _pick(backend, dev)
    if kind == "numba":  # checks the indices in its own pass
        return _numba_delta(widx, old, new, w_old)
    if idx.numel() and int(idx.min()) < 0:
        raise ValueError("indices must be >= 0")
    chunk = (chunk or _chunk(kind, dev)) * per
    return _torch_at(widx, new, w_old, dev, chunk) - _torch_at(widx, old, w_old, dev, chunk)


def fingerprint_deltas(items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], *,
                       backend: Backend = "auto") -> list[Fingerprint]:
    """:func:`fingerprint_delta` of each ``(indices, old_bits, new_bits, width)``, in order: the
    same results, but on the CPU one numba call per element width for all of them (a call costs
    tens of microseconds, and a replica stages a piece per touched tensor per version)."""
    out: list[Fingerprint | None] = [None] * len(items)
    groups: dict[int, list[int]] = {}
    for i, (idx, old, new, width) in enumerate(items):
        cpu = _pick(backend, old.device) == "numba"
        if cpu and width in (8, 16, 32) and old.element_size() * 8 == width == new.element_size() * 8:
            groups.setdefault(width, []).append(i)
        else:  # 64-bit elements, other devices: one at a time
            out[i] = fingerprint_delta(idx, old, new, width, backend=backend)
    for width, members in groups.items():
        idx = [items[i][0].reshape(-1) for i in members]
        olds = [_words(items[i][1])[0] for i in members]
        news = [_words(items[i][2])[0] for i in members]
        if not all(a.shape[0] == b.shape[0] == c.shape[0] for a, b, c in zip(idx, olds, news)):
            raise ValueError("each item needs one old and one new element per index")
        bounds = np.zeros(len(members) + 1, dtype=np.int64)
        np.cumsum([a.shape[0] for a in idx], out=bounds[1:])
        fps = _numba_segments(torch.cat(idx).to(torch.int64), torch.cat(olds), torch.cat(news), width, bounds)
        for i, fp in zip(members, fps):
            out[i] = fp
    return out  # type: ignore[return-value]


_RULES = {"xor": 0, "add": 1, "set": 2}  # the codec's rules for new bits (codec.combine)


@dataclass(frozen=True)
class GatherTarget:
    """Where a tensor's change lands, where this rank holds the tensor (or its share of it) in one
    CPU parameter: element ``start + i`` of the tensor lives at ``target[at + i]`` for each row
    ``(start, length, at)`` of ``runs`` and ``0 <= i < length``. Checked once, when made, and its
    addresses kept: a replica gathers into the same targets every version, and checking each
    again cost more than a tensor of 0.1% changed."""

    target: torch.Tensor  # flat 8-32-bit integer view of a CPU parameter, or of the tensor's one run
    # in it (runs = one_run(numel)): then the positions are the write's indices, and none are made
    runs: torch.Tensor  # int64 (R, 3) on the CPU, by start, disjoint; a position in none is another rank's
    numel: int  # the tensor's elements
    # (target's address and elements, runs' address and rows, numel): the kernel's table row
    row: tuple[int, int, int, int, int] = field(init=False, repr=False, compare=False)
    size: int = field(init=False, repr=False, compare=False)  # bytes an element

    def __post_init__(self) -> None:
        t, runs = self.target, self.runs
        # attribute checks only: a tensor's .device or .shape comparison costs about a microsecond
        if not t.is_cpu or t.dim() != 1 or t.element_size() * 8 not in _UNSIGNED_NP or not t.is_contiguous():
            raise ValueError(f"a flat 8-32-bit CPU tensor to gather from, not {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
        if not isinstance(runs, torch.Tensor) or runs.dtype is not torch.int64 or not runs.is_cpu \
                or not runs.is_contiguous() or runs.dim() != 2 or runs.size(1) != 3:
            runs = torch.as_tensor(np.asarray(runs), dtype=torch.int64).reshape(-1, 3).contiguous()
            object.__setattr__(self, "runs", runs)  # the copy the kernel reads, kept with the target
        object.__setattr__(self, "row", (t.data_ptr(), t.numel(), runs.data_ptr(), runs.size(0), int(self.numel)))
        object.__setattr__(self, "size", t.element_size())


class GatherItem(NamedTuple):
    """One tensor's change to stage into its :class:`GatherTarget`."""

    where: GatherTarget
    positions: torch.Tensor  # int64, the tensor's flat indices
    bits: torch.Tensor  # one value per position, as wide as the target's elements
    mode: str  # the codec's rule for the new bits (shared.codec.combine)


def one_run(numel: int, at: int = 0) -> torch.Tensor:
    """The :attr:`GatherTarget.runs` of a tensor held whole at ``target[at:at + numel]``."""
    return torch.tensor([[0, numel, at]], dtype=torch.int64)


class Gathered(NamedTuple):
    """One item staged: what this rank holds of its change."""

    positions: torch.Tensor  # the tensor's flat indices held here (the item's own when all are)
    dest: torch.Tensor  # where they live in the target (the positions themselves for a target
    # that is the tensor: one run, from 0, at 0)
    old: torch.Tensor  # the target's bits there
    new: torch.Tensor  # the bits after the write, by the item's rule
    lanes: np.ndarray  # four uint64: what the write adds to the fingerprint of the elements held here


def gather_batch(targets: Sequence[GatherTarget], modes: Sequence[str], positions: torch.Tensor,
                 bits: torch.Tensor, bounds: np.ndarray) -> list[Gathered]:
    """Stages the writes of several tensors' changes, all of one element width, in one numba call.
    Tensor ``k`` changes at ``positions[bounds[k]:bounds[k + 1]]`` by ``bits`` there under
    ``modes[k]`` (joined, as :meth:`shared.codec.DeltaFile.decode_batches` gives them) and lands
    in ``targets[k]``. Per tensor: the positions this rank holds, their places in the target, the
    target's bits there, the new bits by the tensor's rule, and what the write adds to the
    fingerprint (:func:`fingerprint_delta` of the old and new bits: under tensor parallelism, of
    this rank's partial). A replica stages each touched tensor every version, and at 0.1% changed
    a call, or a check of its arrays, per tensor cost more than the gather itself."""
    if not targets:
        return []
    size = targets[0].target.element_size()
    width, total = size * 8, positions.numel()
    if positions.dtype is not torch.int64 or positions.dim() != 1 or not positions.is_cpu \
            or not positions.is_contiguous() or bits.dim() != 1 or bits.numel() != total \
            or bits.element_size() != size or not bits.is_cpu or not bits.is_contiguous():
        raise ValueError(f"contiguous int64 positions on the CPU and one {width}-bit value each, not "
                         f"{positions.dtype} {tuple(positions.shape)} and {bits.dtype} {tuple(bits.shape)}")
    bounds = np.asarray(bounds, dtype=np.int64)
    if bounds.shape != (len(targets) + 1,) or bounds[0] != 0 or bounds[-1] != total or np.any(bounds[1:] < bounds[:-1]):
        raise ValueError(f"bounds from 0 to {total}, one more than the {len(targets)} targets")
    rows = []  # per tensor: its target's row and its rule
    for k, (where, mode) in enumerate(zip(targets, modes, strict=True)):
        rule = _RULES.get(mode)
        if rule is None:
            raise ValueError(f"item {k}: unknown rule {mode!r} (one of {sorted(_RULES)})")
        if where.size != size:
            raise ValueError(f"item {k}: a {width}-bit target like item 0's, not {where.target.dtype}")
        rows.append((*where.row, rule))
    u = _UNSIGNED_NP[width]
    # written only where a target is held in runs (a rank's share): else never touched, so not kept
    held, dest = np.empty(total, np.int64), np.empty(total, np.int64)
    old, new = buffers.empty(total, u), buffers.empty(total, u)
    counts = np.empty(len(rows), np.int64)
    direct = np.zeros(len(rows), np.uint8)
    lanes = np.zeros((len(rows), 4), np.uint64)
    failed = _kernels()["gather"](np.array(rows, dtype=np.int64), bounds, width, positions.numpy(),
                                  bits.numpy().view(u), held, dest, old, new, counts, direct, lanes)
    if failed >= 0:
        k = failed // 2
        if failed % 2:
            raise ValueError(f"item {k}: runs out of order, overlapping or outside the target's "
                             f"{rows[k][1]} elements or the tensor's {rows[k][4]}")
        raise ValueError(f"item {k}: positions outside the tensor's {rows[k][4]} elements")
    # one split each, not slices per tensor: tensor k's outputs are the first counts[k] of its span
    signed, counts_, spans = _NP_SIGNED[size], counts.tolist(), np.diff(bounds).tolist()
    if counts_ == spans:  # every position held here (always on one rank)
        sizes, step = spans, 1
        held_t = ours = positions.split(sizes)
    else:
        sizes, step = [s for c, n in zip(counts_, spans) for s in (c, n - c)], 2
        ours = positions.split(spans)
        held_t = [p if c == n else h for p, c, n, h in
                  zip(ours, counts_, spans, torch.from_numpy(held).split(sizes)[::2])]
    if direct.all():  # targets that are their tensors: the positions are the write's indices
        dest_t = ours
    else:
        split = torch.from_numpy(dest).split(sizes)[::step]
        dest_t = [i if d else t for i, d, t in zip(ours, direct.tolist(), split)]
    old_t = torch.from_numpy(old.view(signed)).split(sizes)[::step]
    new_t = torch.from_numpy(new.view(signed)).split(sizes)[::step]
    return list(map(Gathered, held_t, dest_t, old_t, new_t, lanes))


def gather_updates(items: Sequence[GatherItem]) -> list[Gathered]:
    """:func:`gather_batch` of changes held apart (joined here, a copy); where every position of an
    item is held here, its :attr:`Gathered.positions` is the item's own."""
    if not items:
        return []
    size = items[0].where.size
    for k, (_, positions, bits, _) in enumerate(items):
        if positions.dim() != 1 or bits.dim() != 1 or bits.element_size() != size \
                or bits.numel() != positions.numel():
            raise ValueError(f"item {k}: one {8 * size}-bit value per position: {positions.numel()} positions, "
                             f"{bits.dtype} {tuple(bits.shape)}")
    bounds = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([item.positions.numel() for item in items], out=bounds[1:])
    view = _SIGNED[8 * size]  # one dtype to join (int8 and uint8 would widen)
    out = gather_batch([item.where for item in items], [item.mode for item in items],
                       torch.cat([item.positions.to("cpu", torch.int64) for item in items]),
                       torch.cat([item.bits.cpu().view(view) for item in items]), bounds)
    return [g._replace(positions=item.positions) if g.positions.numel() == item.positions.numel() else g
            for item, g in zip(items, out)]


def delta_lanes(indices: np.ndarray, old: np.ndarray, new: np.ndarray, bounds: np.ndarray,
                width: int) -> np.ndarray:
    """:func:`fingerprint_delta` of each segment ``bounds[k]:bounds[k+1]`` of ``indices`` (int64)
    and the ``old`` and ``new`` bits there (numpy, elements of ``width`` = 8, 16 or 32 bits), as
    rows of four uint64 lanes for :func:`add_lanes`, in one kernel call on the CPU: a publisher
    updates every touched tensor's fingerprint each version, and through
    :func:`fingerprint_deltas` (torch views, ``Fingerprint`` objects) that cost ~40 us a tensor,
    most of it at 0.1% changed. The segments come joined, as the coder takes them too."""
    if width not in (8, 16, 32):
        raise ValueError(f"8-32-bit elements, not {width}-bit")
    if not (indices.ndim == old.ndim == new.ndim == 1 and indices.shape[0] == old.shape[0] == new.shape[0]
            and old.itemsize * 8 == new.itemsize * 8 == width and bounds.shape[0] >= 1
            and bounds[0] == 0 and bounds[-1] == indices.shape[0]):
        raise ValueError(f"one old and one new {width}-bit element per index, in segments that cover them")
    u = _UNSIGNED_NP[width]
    return _segment_lanes(indices.astype(np.int64, copy=False), old.view(u), new.view(u), width,
                          bounds.astype(np.int64, copy=False))


def add_lanes(fingerprints: Sequence[str], lanes: np.ndarray) -> list[str]:
    """Each hex fingerprint plus its row of lane sums (``lanes``: one row of four uint64 per
    fingerprint), as hex: the arithmetic of :class:`Fingerprint` on numpy words, in one pass for
    every touched tensor a replica updates each version."""
    if any(len(f) != 64 for f in fingerprints) or lanes.shape != (len(fingerprints), 4):
        raise ValueError(f"64 hex digits and four lanes per fingerprint: {len(fingerprints)} fingerprints, "
                         f"lanes {lanes.shape}")
    acc = np.frombuffer(bytes.fromhex("".join(fingerprints)), dtype=">u8").astype(np.uint64).reshape(-1, 4)
    hexes = (acc + lanes.astype(np.uint64, copy=False)).astype(">u8").tobytes().hex()  # uint64 wraps mod 2**64
    return [hexes[i:i + 64] for i in range(0, len(hexes), 64)]


def fingerprints(state: Mapping[str, torch.Tensor], *, device: str | torch.device | None = None,
                 backend: Backend = "auto") -> dict[str, Fingerprint]:
    """Every tensor's fingerprint; numba spreads the tensors over the shared thread pool."""
    from .changes import map_balanced

    names = list(state)
    on_cpu = [_pick(backend, _device(device, state[n].device)) == "numba" for n in names]
    if all(on_cpu):
        fps = map_balanced(lambda n: tensor_fingerprint(state[n], backend="numba", threads=False), names,
                           [state[n].numel() for n in names])
        return dict(zip(names, fps))
    return {n: tensor_fingerprint(state[n], device=device, backend=backend) for n in names}


def state_fingerprint(entries: Mapping[str, tuple[str, Iterable[int], Fingerprint | str]]) -> str:
    """``blake3`` of ``f"{name}\\t{dtype}\\t{shape}\\t{fingerprint}\\n"`` in name order: the state
    digest's lines with fingerprints in place of digests, from (dtype, shape, fingerprint)."""
    if any(isinstance(fp, Fingerprint) for _, _, fp in entries.values()):  # else all hex already
        entries = {n: (dtype, shape, fp.hex() if isinstance(fp, Fingerprint) else fp)
                   for n, (dtype, shape, fp) in entries.items()}
    return state_digest_from_entries(entries)


def state_fingerprint_of(state: Mapping[str, torch.Tensor], **kwargs) -> str:
    """The state fingerprint computed from the tensors themselves (``kwargs``: see :func:`fingerprints`)."""
    fps = fingerprints(state, **kwargs)
    return state_fingerprint({n: (dtype_name(t.dtype), t.shape, fps[n]) for n, t in state.items()})


# --------------------------------------------------------------------------- torch backend
def _signed(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


_T_K = tuple(_signed(k) for k in K)
_T_M1, _T_M2 = _signed(M1), _signed(M2)


def _torch_mix_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in place on int64, shifts made logical by masking; ``tmp`` is
    scratch of ``z``'s shape (no allocation per step)."""
    for shift, mul in ((30, _T_M1), (27, _T_M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        z.bitwise_xor_(tmp.bitwise_and_((1 << (64 - shift)) - 1))
        if mul is not None:
            z.mul_(mul)  # wraps mod 2**64
    return z


@functools.cache
def _torch_keys(device: torch.device) -> torch.Tensor:
    return torch.tensor(_T_K, dtype=torch.int64, device=device)[:, None]


def _torch_sum(pieces: Iterable[tuple[int, torch.Tensor | None, torch.Tensor]], width: int,
               device: torch.device, chunk: int) -> Fingerprint:
    """Kernel: lane sums over pieces ``(start, word indices or None for start.., words)`` of at most
    ``chunk`` words, all four lanes at once as a (4, chunk) int64 pass, scratch allocated once."""
    x = torch.empty(chunk, dtype=torch.int64, device=device)
    z = torch.empty((4, chunk), dtype=torch.int64, device=device)
    tmp = torch.empty_like(z)
    acc = torch.zeros(4, dtype=torch.int64, device=device)
    for start, idx, words in pieces:
        m = words.shape[0]
        xv, zv = x[:m], z[:, :m]
        if idx is None:
            torch.arange(start, start + m, dtype=torch.int64, device=device, out=xv)
        else:
            xv.copy_(idx, non_blocking=True)
        bits = words.to(device, non_blocking=True).to(torch.int64)  # narrow words cross, then widen
        xv.mul_(1 << width).bitwise_or_(bits.bitwise_and_((1 << width) - 1))
        torch.bitwise_xor(xv[None, :], _torch_keys(device), out=zv)
        acc += _torch_mix_(zv, tmp[:, :m]).sum(dim=1)
    return Fingerprint(tuple(v & MASK64 for v in acc.tolist()))


def _torch_range(words: torch.Tensor, start: int, width: int, device: torch.device, chunk: int) -> Fingerprint:
    n = words.shape[0]
    return _torch_sum(((start + s, None, words[s:s + chunk]) for s in range(0, n, chunk)), width, device,
                      max(1, min(chunk, n)))


def _torch_at(idx: torch.Tensor, words: torch.Tensor, width: int, device: torch.device, chunk: int) -> Fingerprint:
    n = words.shape[0]
    return _torch_sum(((0, idx[s:s + chunk], words[s:s + chunk]) for s in range(0, n, chunk)), width, device,
                      max(1, min(chunk, n)))


def _torch_runs(words: torch.Tensor, pieces: np.ndarray, width: int, device: torch.device,
                chunk: int) -> Fingerprint:
    """Pieces gathered a group at a time (about ``chunk`` words) as indices and words."""
    groups = _groups(pieces, chunk)

    def gathered(first: int, end: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        g = torch.from_numpy(pieces[first:end]).to(words.device)
        lengths = g[:, 1]
        inner = torch.arange(int(lengths.sum()), device=words.device) - \
            torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        at = torch.repeat_interleave(g[:, 2], lengths) + inner
        idx = torch.repeat_interleave(g[:, 0], lengths) + inner
        return 0, idx.to(device), words.index_select(0, at)

    widest = max((int(pieces[a:b, 1].sum()) for a, b in groups), default=1)
    return _torch_sum((gathered(a, b) for a, b in groups), width, device, widest)


# --------------------------------------------------------------------------- numba backend
# Plain functions here, compiled on first use by _kernels(); the constants are read as globals,
# which numba freezes at compile time.
_NK0, _NK1, _NK2, _NK3 = (np.uint64(k) for k in K)
_NM1, _NM2 = np.uint64(M1), np.uint64(M2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
# compiled (inlined into the kernels) by _kernels(), before they compile
_nb_mix = _nb_lanes_into = _nb_address = _nb_carray = None


def _mix(z):  # pragma: no cover - compiled by numba
    z = (z ^ (z >> _S30)) * _NM1
    z = (z ^ (z >> _S27)) * _NM2
    return z ^ (z >> _S31)


def _range_kernel(words, start, width, out):  # pragma: no cover - compiled by numba
    """Lane sums of ``words[j]`` at word index ``start + j``; one pass, four accumulators."""
    sh = np.uint64(width)
    base = np.uint64(start)
    s0, s1, s2, s3 = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
    for j in range(words.shape[0]):
        x = ((base + np.uint64(j)) << sh) | np.uint64(words[j])
        s0 += _nb_mix(x ^ _NK0)
        s1 += _nb_mix(x ^ _NK1)
        s2 += _nb_mix(x ^ _NK2)
        s3 += _nb_mix(x ^ _NK3)
    out[0], out[1], out[2], out[3] = s0, s1, s2, s3


def _runs_kernel(words, pieces, width, out):  # pragma: no cover - compiled by numba
    """:func:`_range_kernel` over each piece ``(start, length, at)``: ``words[at:at + length]``
    at word indices from ``start``, summed."""
    sh = np.uint64(width)
    s0, s1, s2, s3 = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
    for r in range(pieces.shape[0]):
        base, at = np.uint64(pieces[r, 0]), pieces[r, 2]
        for j in range(pieces[r, 1]):
            x = ((base + np.uint64(j)) << sh) | np.uint64(words[at + j])
            s0 += _nb_mix(x ^ _NK0)
            s1 += _nb_mix(x ^ _NK1)
            s2 += _nb_mix(x ^ _NK2)
            s3 += _nb_mix(x ^ _NK3)
    out[0], out[1], out[2], out[3] = s0, s1, s2, s3


def _lanes_into(idx, old, new, width, lo, hi, out):  # pragma: no cover - inlined by numba
    """Lane sums of ``new[j]`` minus those of ``old[j]``, both at word index ``idx[j]``, for
    ``lo <= j < hi``, into ``out``; whether an index was negative. New and old sum apart and the
    sign is tested once: so LLVM keeps the four lanes in one vector register each (written as one
    difference per lane with a test per index, it did not, at 2x the time)."""
    sh = np.uint64(width)
    a0, a1, a2, a3 = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
    b0, b1, b2, b3 = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
    negative = False
    for j in range(lo, hi):
        negative |= idx[j] < 0
        at = np.uint64(idx[j]) << sh
        x, y = at | np.uint64(new[j]), at | np.uint64(old[j])
        a0 += _nb_mix(x ^ _NK0)
        a1 += _nb_mix(x ^ _NK1)
        a2 += _nb_mix(x ^ _NK2)
        a3 += _nb_mix(x ^ _NK3)
        b0 += _nb_mix(y ^ _NK0)
        b1 += _nb_mix(y ^ _NK1)
        b2 += _nb_mix(y ^ _NK2)
        b3 += _nb_mix(y ^ _NK3)
    out[0], out[1], out[2], out[3] = a0 - b0, a1 - b1, a2 - b2, a3 - b3
    return negative


def _delta_kernel(idx, old, new, width, bounds, out):  # pragma: no cover - compiled by numba
    """Per segment ``k`` (``bounds[k]:bounds[k+1]``), :func:`_lanes_into` ``out[k]``; False if
    an index is negative."""
    for k in range(bounds.shape[0] - 1):
        if _nb_lanes_into(idx, old, new, width, bounds[k], bounds[k + 1], out[k]):
            return False
    return True


def _gather_kernel(table, bounds, width, positions, bits, held, dest, old, new, counts, direct,
                   out):  # pragma: no cover - numba
    """The writes of :func:`gather_batch` staged. Tensor ``k`` is ``table[k]`` = (address of
    its target, the target's elements, address of its runs, the run count, the tensor's elements,
    its rule: 0 ``old ^ bits``, 1 ``old + bits`` wrapping, 2 ``bits``) and owns
    ``bounds[k]:bounds[k+1]`` of ``positions``, ``bits`` and the outputs, of which it fills the
    first ``counts[k]`` (not ``dest`` where it sets ``direct[k]``: the target is the tensor, one
    run at 0). Returns -1, or with nothing read ``2k`` for tensor ``k``'s positions outside it,
    ``2k + 1`` for its runs. One pass per step (gather, rule, fingerprint): fused into one loop,
    the gather's loads and the stores kept LLVM from vectorising the lanes, at 2.5x the time."""
    for k in range(bounds.shape[0] - 1):
        runs = _nb_carray(_nb_address(table[k, 2], dest), (table[k, 3], 3))
        numel, end = table[k, 4], 0
        for r in range(runs.shape[0]):
            if runs[r, 0] < end or runs[r, 1] < 0 or runs[r, 2] < 0 or runs[r, 2] + runs[r, 1] > table[k, 1]:
                return 2 * k + 1
            end = runs[r, 0] + runs[r, 1]
        if end > numel:
            return 2 * k + 1
        for j in range(bounds[k], bounds[k + 1]):
            if positions[j] < 0 or positions[j] >= numel:
                return 2 * k
    for k in range(bounds.shape[0] - 1):
        lo, hi = bounds[k], bounds[k + 1]
        mode, numel = table[k, 5], table[k, 4]
        pos, src = positions[lo:hi], bits[lo:hi]
        runs = _nb_carray(_nb_address(table[k, 2], dest), (table[k, 3], 3))
        target = _nb_carray(_nb_address(table[k, 0], old), table[k, 1])
        d, o, n = dest[lo:hi], old[lo:hi], new[lo:hi]
        if runs.shape[0] == 1 and runs[0, 0] == 0 and runs[0, 1] == numel and runs[0, 2] == 0:
            for j in range(hi - lo):  # the target is the tensor: the positions are where (no dest)
                o[j] = target[pos[j]]
            c, at_ = hi - lo, pos
            direct[k] = 1
            if mode == 2:
                n[:] = src
        else:  # held in runs, some perhaps on other ranks
            c, r, last = 0, 0, runs.shape[0] - 1
            h = held[lo:hi]
            for j in range(hi - lo if last >= 0 else 0):
                p = pos[j]
                if p < runs[r, 0] or p >= runs[r, 0] + runs[r, 1]:  # not the current run
                    if r < last and runs[r, 0] + runs[r, 1] <= p < runs[r + 1, 0]:
                        continue  # in the gap after it: another rank's (positions come sorted)
                    if r < last and runs[r + 1, 0] <= p < runs[r + 1, 0] + runs[r + 1, 1]:
                        r += 1  # the next one
                    else:  # by bisection: the last run starting at or before p
                        a, b = 0, last + 1
                        while b - a > 1:
                            m = (a + b) // 2
                            if runs[m, 0] <= p:
                                a = m
                            else:
                                b = m
                        r = a
                        if p < runs[r, 0] or p >= runs[r, 0] + runs[r, 1]:
                            continue  # another rank's
                h[c] = p
                d[c] = runs[r, 2] + p - runs[r, 0]
                o[c] = target[d[c]]
                n[c] = src[j]
                c += 1
            at_, src = h, n
        counts[k] = c
        if mode == 0:
            for j in range(c):
                n[j] = o[j] ^ src[j]
        elif mode == 1:
            for j in range(c):
                n[j] = o[j] + src[j]  # truncated to the element width by the store
        _nb_lanes_into(at_, o, n, width, 0, c, out[k])
    return -1


_KERNELS = None
_KERNELS_LOCK = threading.Lock()


def _kernels():
    """The compiled kernels, built once: the first callers are the thread pool's workers, all at
    once, and the inlined helpers must be bound before any kernel compiles. Later calls read
    them without the lock."""
    global _KERNELS, _nb_mix, _nb_lanes_into, _nb_address, _nb_carray
    if _KERNELS is not None:
        return _KERNELS
    with _KERNELS_LOCK:
        if _KERNELS is None:
            import numba

            from .kernels import address_as

            _nb_mix = numba.njit(inline="always")(_mix)
            _nb_lanes_into = numba.njit(inline="always")(_lanes_into)
            _nb_address, _nb_carray = address_as, numba.carray
            jit = numba.njit(cache=True, nogil=True)
            _KERNELS = {"range": jit(_range_kernel), "runs": jit(_runs_kernel), "delta": jit(_delta_kernel),
                        "gather": jit(_gather_kernel)}
        return _KERNELS


def _np_words(words: torch.Tensor, width: int) -> np.ndarray:
    return (words if words.is_contiguous() else words.contiguous()).numpy().view(_UNSIGNED_NP[width])


def _numba_range(words: torch.Tensor, start: int, width: int, threads: bool, chunk: int) -> Fingerprint:
    range_kernel = _kernels()["range"]
    w = _np_words(words, width)

    def part(s: int) -> Fingerprint:
        out = np.zeros(4, dtype=np.uint64)
        range_kernel(w[s:s + chunk], start + s, width, out)
        return Fingerprint(tuple(out.tolist()))

    starts = range(0, w.shape[0], chunk)
    if threads and len(starts) > 1:
        # the chunk pool find_changes uses, apart from the tensor pool (no task waits on its own queue)
        from .changes import _pool

        return sum(_pool("chunks").map(part, starts), ZERO)
    return sum(map(part, starts), ZERO)


def _numba_runs(words: torch.Tensor, pieces: np.ndarray, width: int, chunk: int) -> Fingerprint:
    """Groups of about ``chunk`` words on the chunk threads."""
    runs_kernel = _kernels()["runs"]
    w = _np_words(words, width)

    def part(group: tuple[int, int]) -> Fingerprint:
        out = np.zeros(4, dtype=np.uint64)
        runs_kernel(w, pieces[group[0]:group[1]], width, out)
        return Fingerprint(tuple(out.tolist()))

    groups = _groups(pieces, chunk)
    if len(groups) > 1:
        from .changes import _pool

        return sum(_pool("chunks").map(part, groups), ZERO)
    return sum(map(part, groups), ZERO)


def _numba_delta(idx: torch.Tensor, old: torch.Tensor, new: torch.Tensor, width: int) -> Fingerprint:
    return _numba_segments(idx, old, new, width, np.array([0, idx.shape[0]], dtype=np.int64))[0]


SPLIT_MIN = 1 << 16  # indices below which an update of several segments stays on one thread


def _numba_segments(idx: torch.Tensor, old: torch.Tensor, new: torch.Tensor, width: int,
                    bounds: np.ndarray) -> list[Fingerprint]:
    """:func:`_segment_lanes` of torch words, as fingerprints."""
    i = (idx if idx.is_contiguous() else idx.contiguous()).numpy()
    out = _segment_lanes(i, _np_words(old, width), _np_words(new, width), width, bounds)
    return [Fingerprint(tuple(row)) for row in out.tolist()]


def _segment_lanes(i: np.ndarray, o: np.ndarray, n: np.ndarray, width: int, bounds: np.ndarray) -> np.ndarray:
    """One update per segment ``bounds[k]:bounds[k+1]`` of the (word) indices and bits, as rows
    of four lanes; many segments are split into runs of about equal size on the chunk threads."""
    from .changes import _pool

    delta_kernel = _kernels()["delta"]
    out = np.zeros((bounds.shape[0] - 1, 4), dtype=np.uint64)
    runs = [(0, bounds.shape[0] - 1)]
    if bounds[-1] >= SPLIT_MIN and bounds.shape[0] > 2:
        workers = _pool("chunks")._max_workers
        cuts = np.searchsorted(bounds, np.linspace(0, bounds[-1], workers + 1)[1:-1])
        edges = sorted({0, *cuts.tolist(), bounds.shape[0] - 1})
        runs = list(zip(edges[:-1], edges[1:]))

    def run(r: tuple[int, int]) -> bool:
        return delta_kernel(i, o, n, width, bounds[r[0]:r[1] + 1], out[r[0]:r[1]])

    ok = list(_pool("chunks").map(run, runs)) if len(runs) > 1 else [run(runs[0])]
    if not all(ok):
        raise ValueError("indices must be >= 0")
    return out
