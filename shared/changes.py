"""Bit-exact change detection between two snapshots of a tensor.

Two backends with identical results. On the host, one fused pass over blocks of 64 elements
(numba, GIL released so tensors run on all cores): compare, record the position and XOR of each
changed element, and optionally refresh the old snapshot in place. Writing only the changed
elements keeps the snapshot update nearly free at ~1% change. Where the weights live on an
accelerator, torch ops on that device do the same (compare 16/32-bit views, ``nonzero``,
``index_copy_``) and only the positions and XORs cross to the host: a few bytes per changed
element instead of the model.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Integer views for the float dtypes whose bits we diff; other dtypes are sent whole.
INT_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
}
UNSIGNED_NP = {torch.int16: np.uint16, torch.int32: np.uint32}
SIGNED_NP = {torch.int16: np.int16, torch.int32: np.int32}
CHUNK_ELEMENTS = 1 << 22  # elements per task: big enough to amortise, small enough to balance


@dataclass
class Changes:
    """Changed positions (flat C-order, sorted), the XOR of old and new bits there and, where
    the scan recorded them, the new bits there."""

    positions: np.ndarray  # int64
    xor: np.ndarray  # unsigned int of the element width
    new: np.ndarray | None = None  # the same type; None: gather them from the new tensor

    @property
    def count(self) -> int:
        return int(self.positions.shape[0])


def unsigned_view(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view of a float tensor's bits (no copy)."""
    iv = INT_VIEW[t.dtype]
    return t.detach().reshape(-1).view(iv).numpy().view(UNSIGNED_NP[iv])


_SCRATCH = threading.local()


def _scratch(cap: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-thread output buffers (positions, XORs, new bits), reused across calls: fresh pages
    cost a fault each (very expensive in a microVM), and the result is copied out at its true,
    small size anyway."""
    out = []
    for key, t in (("pos", np.dtype(np.int64)), ("xor_" + dtype.str, dtype), ("new_" + dtype.str, dtype)):
        buf = getattr(_SCRATCH, key, None)
        if buf is None or buf.shape[0] < cap:
            buf = np.empty(cap, dtype=t)
            setattr(_SCRATCH, key, buf)
        out.append(buf[:cap])
    return tuple(out)


def _scan_chunk(old: np.ndarray, new: np.ndarray, start: int, stop: int, cap: int, update: bool):
    from .kernels import scan_changes

    pos, xor, bits = _scratch(cap, old.dtype)
    k = scan_changes(old[start:stop], new[start:stop], pos, xor, bits, start, update)
    return k, Changes(pos[:min(k, cap)].copy(), xor[:min(k, cap)].copy(), bits[:min(k, cap)].copy())


def _undo(old: np.ndarray, found: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Take back the refresh of the chunks that did not overflow (an overflowing or refusing
    chunk has taken back its own), so that a None never half-updates."""
    from .kernels import xor_scatter

    for pos, xor in found:
        xor_scatter(old, pos, xor, 0)


_POOLS: dict[str, ThreadPoolExecutor] = {}
# A forked child (a DataLoader worker, a zygote's command) inherits the pools but not their
# threads: work submitted there would wait forever. It starts pools of its own instead.
os.register_at_fork(after_in_child=_POOLS.clear)


def _pool(kind: str) -> ThreadPoolExecutor:
    if kind not in _POOLS:
        _POOLS[kind] = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix=f"deltasync-{kind}")
    return _POOLS[kind]


def tensor_pool() -> ThreadPoolExecutor:
    """Threads for work across tensors; chunks of one tensor use a pool of their own, so a
    tensor task never waits on a queue that it is itself blocking."""
    return _pool("tensors")


# Changed elements below which work over tensors (a trainer's encoding, a replica's staging, a
# library apply) stays on the calling thread. That work is many short kernel calls between
# Python steps, and on two threads each return from a kernel waits for the GIL behind the other
# thread's Python: up to ~1M changes one thread was faster (encoding 26M parameters: 19.7
# against 39.0 ms at 0.1% changed, 34.6 against 50.6 ms at 1%; 79M at 1%: 63 against 83 ms;
# staging 25M at 1% in vLLM: 12.2 against 14.8 ms).
THREADS_FROM_CHANGES = 1 << 20


def map_balanced(fn, items: list, weights: list[int], progress=None, serial_below: int = 0) -> list:
    """``[fn(x) for x in items]`` on one batch per thread, batches balanced by weight: a task
    per item costs more in hand-offs than many small items take to run. ``progress``: a tqdm
    bar to advance by each item's weight. ``serial_below``: a total weight under which it all
    runs on the calling thread."""
    def run(batch: list) -> list:
        out = []
        for x, w in batch:
            out.append(fn(x))
            if progress is not None:
                progress.update(w)
        return out

    return map_batches(run, list(zip(items, weights)), weights, serial_below)


def map_batches(fn, items: list, weights: list[int], serial_below: int = 0) -> list:
    """``fn(batch)`` for one batch of ``items`` per thread (batches balanced by weight), each
    returning a result per item of its batch; the results in the order of ``items``. For work
    that is cheaper done for many items in one call. ``serial_below``: a total weight under which
    ``fn(items)`` runs on the calling thread."""
    if sum(weights) < serial_below:
        return list(fn(list(items)))
    workers = tensor_pool()._max_workers
    batches: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        b = load.index(min(load))
        batches[b].append(i)
        load[b] += weights[i] + 1
    batches = [sorted(b) for b in batches if b]
    out: list = [None] * len(items)

    def run(batch: list[int]) -> None:
        for i, r in zip(batch, fn([items[i] for i in batch]), strict=True):
            out[i] = r

    futures = []
    for i, batch in enumerate(batches):
        try:
            futures.append(tensor_pool().submit(run, batch))
        except RuntimeError:  # the interpreter is exiting (an atexit close()): no new pool tasks
            for rest in batches[i:]:
                run(rest)
            break
    for f in futures:
        f.result()
    return out


def _chunks(numel: int, max_fraction: float) -> list[tuple[int, int, int]]:
    """(start, stop, cap): the dense-change rule works per chunk, the same for both backends."""
    return [(s, min(s + CHUNK_ELEMENTS, numel), int((min(s + CHUNK_ELEMENTS, numel) - s) * max_fraction) + 1)
            for s in range(0, numel, CHUNK_ELEMENTS)]


def find_changes(old: torch.Tensor, new: torch.Tensor, *, update: bool = False,
                 max_fraction: float = 1 / 16, threads: bool = True, backend: str = "auto") -> Changes | None:
    """Positions and XOR of the elements whose bits differ.

    Returns None when more than ``max_fraction`` of some chunk's elements changed (the scan
    stops at that chunk's cap): the caller then takes the change in one pass over every element
    (:func:`shared.codec.full_pass_change`). With ``update=True`` the old snapshot is
    refreshed in place (only when the result is not None, so a None never half-updates).
    ``threads=False`` scans in the calling thread (for callers that parallelise across tensors).
    ``backend``: ``"numba"`` (host tensors), ``"torch"`` (torch ops on the tensors' device, CPU
    included) or ``"auto"`` (torch where the tensors live off the CPU, else numba). The result
    is on the host either way.
    """
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        raise ValueError(f"shape/dtype/device mismatch: {old.shape}/{old.dtype}/{old.device} vs "
                         f"{new.shape}/{new.dtype}/{new.device}")
    if not (old.is_contiguous() and new.is_contiguous()):
        raise ValueError("find_changes needs contiguous tensors")
    if backend not in ("auto", "numba", "torch"):
        raise ValueError(f"unknown backend {backend!r}: auto, numba or torch")
    if backend == "torch" or (backend == "auto" and old.device.type != "cpu"):
        return _find_changes_torch(old, new, update, max_fraction)
    o, n = unsigned_view(old), unsigned_view(new)
    chunks = _chunks(o.shape[0], max_fraction)
    scan = lambda c: _scan_chunk(o, n, *c, update)  # noqa: E731 - the refresh is fused into the scan
    results = list(_pool("chunks").map(scan, chunks) if threads and len(chunks) > 1 else map(scan, chunks))
    if any(k > cap for (k, _), (_, _, cap) in zip(results, chunks)):
        if update:
            _undo(o, [(c.positions, c.xor) for (k, c), (_, _, cap) in zip(results, chunks) if k <= cap])
        return None
    if len(results) == 1:  # already copied out of the scratch buffers
        return results[0][1]
    if not results:
        return Changes(np.empty(0, np.int64), np.empty(0, o.dtype), np.empty(0, o.dtype))
    return Changes(*(np.concatenate(parts) for parts in zip(*((c.positions, c.xor, c.new) for _, c in results))))


TORCH_SLICE = CHUNK_ELEMENTS * 16  # elements compared at once on a device: bounds the bool mask


def _find_changes_torch(old: torch.Tensor, new: torch.Tensor, update: bool,
                        max_fraction: float) -> Changes | None:
    """The numba scan's result with torch ops on the tensors' own device.

    Compares integer views slice by slice (the bool mask and ``nonzero`` stay bounded), decides
    dense vs sparse by the same per-chunk rule, then gathers the XORs and (``update``) writes the
    new bits at the changed positions only. Positions cross as int32 when they fit: with the XORs
    that is 6 bytes per changed bf16 element.
    """
    iv = INT_VIEW[old.dtype]
    o, n = old.view(-1).view(iv), new.view(-1).view(iv)
    numel = o.shape[0]
    found = [torch.nonzero(o[s:s + TORCH_SLICE] != n[s:s + TORCH_SLICE]).squeeze(1) + s
             for s in range(0, numel, TORCH_SLICE)]
    pos = torch.cat(found) if len(found) > 1 else found[0] if found else o.new_empty(0, dtype=torch.int64)
    chunks = _chunks(numel, max_fraction)
    if chunks and pos.shape[0] > min(cap for _, _, cap in chunks):  # some chunk may be dense: count
        counts = torch.bincount(pos // CHUNK_ELEMENTS, minlength=len(chunks)).tolist()
        if any(k > cap for k, (_, _, cap) in zip(counts, chunks)):
            return None
    new_at = n.index_select(0, pos)
    xor = o.index_select(0, pos) ^ new_at
    if update:
        o.index_copy_(0, pos, new_at)
    narrow = torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64
    positions = pos.to(narrow).cpu().numpy().astype(np.int64)
    return Changes(positions, xor.cpu().numpy().view(UNSIGNED_NP[iv]))


def find_cast_changes(old: torch.Tensor, live: torch.Tensor, *, update: bool = False,
                      max_fraction: float = 1 / 16) -> Changes | None | bool:
    """:func:`find_changes` of fp32 host weights cast to bf16 against a bf16 snapshot, without
    materialising the cast (one pass instead of a cast and a compare). The same per-chunk dense
    rule (None); False where the fused cast does not apply (NaN or subnormal weights, another
    dtype or layout): then cast with torch and call :func:`find_changes`."""
    return find_changes_many([(old, live)], update=update, max_fraction=max_fraction, cast=True,
                             max_changes=None)[0]


BATCH_CHANGES = 1 << 21  # the most changes one scan_many call may record: bounds its buffers


def _cap_total(numel: int, max_fraction: float) -> int:
    """The sum of a tensor's chunk caps (:func:`_chunks`): what its scan may record."""
    full, rest = divmod(numel, CHUNK_ELEMENTS)
    return full * (int(CHUNK_ELEMENTS * max_fraction) + 1) + (int(rest * max_fraction) + 1 if rest else 0)


def scannable(old: torch.Tensor, new: torch.Tensor, cast: bool = False) -> bool:
    """Whether :func:`find_changes_many` takes the pair (with ``cast``: a bf16 snapshot of fp32
    weights): host tensors, contiguous, of one shape, of a dtype whose bits it compares."""
    kind = (old.dtype == torch.bfloat16 and new.dtype == torch.float32) if cast else \
        (old.dtype == new.dtype and old.dtype in INT_VIEW)
    return kind and old.is_cpu and new.is_cpu and old.is_contiguous() and new.is_contiguous() \
        and old.shape == new.shape


def find_changes_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, update: bool = False,
                      max_fraction: float = 1 / 16, cast: bool = False,
                      max_changes: int | None = BATCH_CHANGES) -> list[Changes | None | bool]:
    """:func:`find_changes` of many ``(old, new)`` host pairs on the calling thread, or with
    ``cast`` :func:`find_cast_changes` of many ``(bf16 snapshot, fp32 live)`` pairs, in one
    kernel call per element width (more where their caps exceed ``max_changes``): a trainer
    scans every tensor every version, and a call per tensor cost ~25 us of numba's argument
    checks and numpy views, more than scanning a small tensor. Per pair: its :class:`Changes`,
    None for a dense change, or False where the kernel does not apply (a dtype, shape, layout or
    device it does not take, a tensor whose caps alone exceed ``max_changes``, and with ``cast``
    NaN or subnormal weights): then call the one-tensor function."""
    from .kernels import scan_many

    out: list[Changes | None | bool] = [False] * len(pairs)
    groups: dict[int, list[tuple[int, int]]] = {}  # element size -> (pair, its caps' sum)
    for i, (old, new) in enumerate(pairs):
        if scannable(old, new, cast):
            caps = _cap_total(old.numel(), max_fraction)
            if max_changes is None or caps <= max_changes:
                groups.setdefault(old.element_size(), []).append((i, caps))
    for members in groups.values():
        u = np.dtype(UNSIGNED_NP[INT_VIEW[pairs[members[0][0]][0].dtype]])
        like_old, like_new = np.empty(0, u), np.empty(0, np.uint32 if cast else u)
        batch, total = [], 0
        for i, caps in members + [(None, 0)]:
            if batch and (i is None or (max_changes is not None and total + caps > max_changes)):
                table = np.array([(pairs[j][0].data_ptr(), pairs[j][1].data_ptr(), pairs[j][0].numel())
                                  for j in batch], dtype=np.int64)
                counts = np.empty(len(batch), np.int64)
                pos, xor, bits = _scratch(total, u)
                k = scan_many(table, like_old, like_new, CHUNK_ELEMENTS, max_fraction, pos, xor, bits, counts,
                              update, cast)
                kept = np.maximum(counts, 0)
                ends = np.cumsum(kept)[:-1]
                for j, c, p, x, b in zip(batch, counts.tolist(), np.split(pos[:k].copy(), ends),
                                         np.split(xor[:k].copy(), ends), np.split(bits[:k].copy(), ends)):
                    out[j] = Changes(p, x, b) if c >= 0 else (None if c == -1 else False)
                batch, total = [], 0
            if i is not None:
                batch.append(i)
                total += caps
    return out
