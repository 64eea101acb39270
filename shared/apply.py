"""Apply a decoded delta in place, all or nothing.

Two kinds of patch, both with ``apply()`` and ``revert()``:

* :class:`Patch` holds plain new bits and the old bits gathered from the live tensor. Writing is
  an ``index_copy_``: idempotent (an aliased tensor written twice is harmless) and undone by one
  more ``index_copy_``. This is what a server wants inside a pause: all the work before it.
* :class:`InPlacePatch` XORs or adds the stored bits in place in one pass on CPU tensors: no
  gather and no copy of old values, since either is undone by itself (XOR) or its negation
  (add); every tensor of a decoded batch in one kernel call. It remembers whether it is
  applied, so it is never applied twice.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .changes import INT_VIEW, THREADS_FROM_CHANGES, map_balanced, map_batches
from .codec import DecodedBatch, DeltaFile, Header, TensorChange, TensorEntry, holds
from .digest import TORCH_DTYPES
from .errors import DeltaError


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """Flat view of a tensor's storage as the integer type the codec uses for its bits."""
    flat = t.detach().view(-1)
    return flat.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else flat


@dataclass
class Patch:
    name: str
    target: torch.Tensor  # flat integer view of live storage
    positions: torch.Tensor | None  # None: every element
    new: torch.Tensor
    old: torch.Tensor
    applied: bool = False

    def apply(self) -> None:
        _write(self.target, self.positions, self.new)
        self.applied = True

    def revert(self) -> None:
        _write(self.target, self.positions, self.old)
        self.applied = False


_RULES = {"xor": 0, "add": 1}  # shared.kernels.scatter_many's rules


class InPlacePatch:
    def __init__(self, names: Sequence[str], modes: Sequence[str], targets: Sequence[torch.Tensor],
                 positions: torch.Tensor, bits: torch.Tensor, bounds: Sequence[int] | np.ndarray,
                 members: Sequence[int] | None = None):
        """Tensor ``k`` (``names[k]``, flat integer view ``targets[k]`` of live CPU storage)
        changes at ``positions[bounds[k]:bounds[k + 1]]`` by ``bits`` there under ``modes[k]``
        (joined, as :meth:`shared.codec.DeltaFile.decode_batches` gives them); ``members``: the
        tensors of those to write (default all)."""
        members = range(len(names)) if members is None else members
        if not positions.is_cpu or positions.dtype is not torch.int64 or not positions.is_contiguous() or \
                not bits.is_cpu or not bits.is_contiguous() or bits.shape != positions.shape:
            raise ValueError("contiguous int64 positions on the CPU and one value each")
        rows = []
        for k in members:
            t = targets[k]
            if not t.is_cpu or t.dim() != 1 or not t.is_contiguous() or t.element_size() != bits.element_size() \
                    or modes[k] not in _RULES:
                raise ValueError(f"{names[k]}: a flat CPU target of {bits.dtype} bits, changed by XOR or add")
            rows.append((t.data_ptr(), t.numel(), _RULES[modes[k]], bounds[k], bounds[k + 1]))
        self.names = [names[k] for k in members]
        self.positions, self.bits = positions, bits
        self._targets = [targets[k] for k in members]  # kept alive: the table holds their addresses
        self._table = np.array(rows, dtype=np.int64).reshape(-1, 5)
        self.applied = False

    @classmethod
    def of(cls, change: TensorChange, target: torch.Tensor) -> InPlacePatch:
        return cls([change.name], [change.mode], [target], change.positions, change.bits, [0, change.positions.numel()])

    def _run(self, sign: int) -> None:
        from .kernels import scatter_many

        bits = self.bits.numpy()
        bad = scatter_many(self._table, bits[:0], self.positions.numpy(), bits, sign)
        if bad >= 0:
            raise ValueError(f"{self.names[bad]}: positions outside its {self._table[bad, 1]} elements")

    def apply(self) -> None:
        if not self.applied:
            self._run(1)
            self.applied = True

    def revert(self) -> None:
        if self.applied:
            self._run(-1)
            self.applied = False


def _write(target: torch.Tensor, positions: torch.Tensor | None, bits: torch.Tensor) -> None:
    if positions is None:
        target.copy_(bits.reshape(-1).view(target.dtype) if bits.dtype != target.dtype else bits.reshape(-1))
    else:
        target.index_copy_(0, positions, bits)


def landed(patches: Sequence[Patch]) -> list[bool]:
    """Whether each patch's target holds its new bits, read back bit for bit. The CPU patches at
    listed positions are read in one kernel call per element width
    (:func:`~shared.kernels.equal_at_many`); the others (every element, another device) through
    torch."""
    from .kernels import equal_at_many

    out: list[bool | None] = [None] * len(patches)
    widths: dict[int, list[int]] = {}
    for i, p in enumerate(patches):
        t, pos, new = p.target, p.positions, p.new
        if pos is not None and t.is_cpu and t.dim() == 1 and t.is_contiguous() and pos.is_cpu \
                and pos.dtype is torch.int64 and pos.is_contiguous() and new.is_cpu and new.is_contiguous() \
                and new.element_size() == t.element_size() and new.numel() == pos.numel():
            widths.setdefault(t.element_size(), []).append(i)
        else:
            got = t if pos is None else t.index_select(0, pos.to(t.device, torch.int64))
            out[i] = got.dtype == new.dtype and torch.equal(flat_bits(got), flat_bits(new))
    for size, members in widths.items():
        table = np.array([(patches[i].target.data_ptr(), patches[i].target.numel(), patches[i].positions.data_ptr(),
                           patches[i].new.data_ptr(), patches[i].new.numel()) for i in members], dtype=np.int64)
        ok = np.empty(len(members), dtype=np.uint8)
        equal_at_many(table, np.empty(0, dtype=f"u{size}"), ok)  # bits compared as unsigned words
        for i, v in zip(members, ok.tolist()):
            out[i] = bool(v)
    return out  # type: ignore[return-value]


def make_patch(change: TensorChange, target: torch.Tensor, *,
               in_place: bool = False) -> Patch | InPlacePatch:
    """A patch for one change onto its live flat target. ``in_place`` allows an
    :class:`InPlacePatch` (CPU, XOR or add at listed positions); otherwise old bits are gathered
    now and the write is a plain copy."""
    if (in_place and change.mode in ("xor", "add") and change.positions is not None
            and target.device.type == "cpu"):
        return InPlacePatch.of(change, target)
    if change.positions is None:
        old = target.clone()
    else:
        old = target.index_select(0, change.positions)
    new = change.bits.reshape(-1) if change.mode == "full" else change.new_bits(old)
    if change.mode == "full" and new.dtype != target.dtype:
        new = new.view(target.dtype)
    return Patch(change.name, target, change.positions, new, old)


def check_target(header: Header, target: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(set(header.tensors) - set(target))
    if missing:
        raise DeltaError("shape_mismatch", f"target lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, e in header.tensors.items():
        t = target[name]
        if list(t.shape) != e.shape or t.dtype != TORCH_DTYPES[e.dtype]:
            raise DeltaError("shape_mismatch", f"{name}: target is {tuple(t.shape)}/{t.dtype}, "
                             f"delta says {tuple(e.shape)}/{e.dtype}")


def check_base(header: Header, *, version: int | None, commitment: str | None,
               state_digest: str | None = None) -> None:
    """Refuse a delta that does not start exactly where the target is.

    A target known by commitment (a replica in a chain) is checked by commitment and version; a
    plain checkpoint, which has no commitment, by its state digest.
    """
    if header.kind != "delta":
        return
    if state_digest is not None and header.base_state_digest and header.base_state_digest != state_digest:
        raise DeltaError("wrong_base", f"delta v{header.version} builds on state "
                         f"{header.base_state_digest[:12]}…, target is {state_digest[:12]}…")
    if commitment is not None and header.base_commitment != commitment:
        raise DeltaError("wrong_base", f"delta v{header.version} builds on commitment "
                         f"{header.base_commitment[:12]}…, target holds {commitment[:12]}…")
    if version is not None and header.base_version != version:
        raise DeltaError("out_of_order", f"delta v{header.version} builds on v{header.base_version}, "
                         f"target is at v{version}")


def prepare(delta: DeltaFile, target: Mapping[str, torch.Tensor], *,
            in_place: bool = True) -> list[Patch | InPlacePatch]:
    """Decode (and gather) everything needed; touches no weight, so any error leaves all as it was.

    Tensors that share storage (tied weights listed twice) always get gathering patches, so
    the XOR is not applied once per name.
    """
    check_target(delta.header, target)
    storages = [target[n].untyped_storage().data_ptr() for n in delta.header.tensors]
    in_place = in_place and len(set(storages)) == len(storages)
    names = [n for n, e in delta.header.tensors.items() if e.encoding != "same"]
    delta.verify()  # once, before the threads decode

    def batch(members: list[str]) -> list[Patch | InPlacePatch | None]:
        batches, single = delta.decode_batches(members, base=target.__getitem__)
        patches = {n: make_patch(c, flat_bits(target[n]), in_place=in_place) for n, c in single.items()}
        for b in batches:
            patches.update(_batch_patches(b, target, in_place))
        return [patches.get(n) for n in members]

    return [p for p in map_batches(batch, names, [delta.header.tensors[n].changed for n in names],
                                   serial_below=THREADS_FROM_CHANGES) if p is not None]


def _batch_patches(batch: DecodedBatch, target: Mapping[str, torch.Tensor],
                   in_place: bool) -> dict[str, Patch | InPlacePatch | None]:
    """A decoded batch's patches by name: its XOR and add changes on CPU tensors in one
    :class:`InPlacePatch` (under its first name, None under the others), the rest one each."""
    flats = [flat_bits(target[n]) for n in batch.names]
    fused = [k for k, (m, t) in enumerate(zip(batch.modes, flats)) if in_place and m in _RULES and t.is_cpu]
    out: dict[str, Patch | InPlacePatch | None] = {}
    if fused:
        out = dict.fromkeys((batch.names[k] for k in fused), None)
        out[batch.names[fused[0]]] = InPlacePatch(batch.names, batch.modes, flats, batch.positions, batch.bits,
                                                  batch.bounds, fused)
    if len(fused) < len(batch.names):
        out.update((c.name, make_patch(c, flat)) for c, flat in zip(batch.changes(), flats) if c.name not in out)
    return out


class _Writes:
    """Run patch writes on the tensor threads so that a failure stops them all: once one write
    fails (or the caller is interrupted), no batch starts another write, and :meth:`stop` returns
    only when the writes in flight have finished, so a rollback after it sees every write."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._stopped = False
        self._active = 0
        self.error: BaseException | None = None

    def one(self, p: Patch | InPlacePatch) -> None:
        with self._cond:
            if self._stopped:
                return
            self._active += 1
        try:
            p.apply()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by run()
            with self._cond:
                if self.error is None:
                    self.error = e
                self._stopped = True
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.wait_for(lambda: self._active == 0)

    def run(self, patches: list[Patch | InPlacePatch]) -> None:
        """The writes, on the calling thread below :data:`~shared.changes.THREADS_FROM_CHANGES`
        elements (as :func:`prepare` decodes): on two threads, a write per tensor of a small
        delta waited on the lock and the GIL (1% of 26M: 7.1 against 6.6 ms, 0.1%: 2.9 against
        2.2, prepare included)."""
        try:
            map_balanced(self.one, patches,
                         [p.target.numel() if p.positions is None else p.positions.numel() for p in patches],
                         serial_below=THREADS_FROM_CHANGES)
        finally:
            self.stop()
        if self.error is not None:
            raise self.error


def write_all(patches: list[Patch | InPlacePatch], verify: Mapping[str, TensorEntry] | None = None,
              target: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write all patches (several tensors at a time); if a tensor in ``verify`` (name -> its
    entry) then does not hold the entry's target (:func:`~shared.codec.holds`: by digest, or by
    fingerprint where the delta has no digest), or anything else fails, revert every write.

    All or nothing under threads too: after a failed write no other batch writes, and the
    rollback starts only once every write in flight has finished."""
    writes = _Writes()
    try:
        writes.run(patches)
        names = list(verify or {})
        held = map_balanced(lambda n: holds(verify[n], target[n]), names, [target[n].numel() for n in names])
        for name, ok in zip(names, held):
            if not ok:
                raise DeltaError("digest_mismatch", f"{name}: digest after apply does not match")
    except BaseException:
        writes.stop()  # an interrupt while waiting on the threads: let them finish first
        for p in reversed(patches):
            if p.applied:
                p.revert()
        raise


def apply_delta(delta: DeltaFile, target: Mapping[str, torch.Tensor] | torch.nn.Module, *,
                version: int | None = None, commitment: str | None = None,
                state_digest: str | None = None, verify: bool = True) -> Header:
    """Apply an anchor or delta in place; on any failure the target is left exactly as it was."""
    from .checkpoint import module_state

    state = module_state(target) if isinstance(target, torch.nn.Module) else target
    check_base(delta.header, version=version, commitment=commitment, state_digest=state_digest)
    patches = prepare(delta, state)
    touched = {n: e for n, e in delta.header.tensors.items() if e.encoding != "same"} if verify else None
    with torch.no_grad():
        write_all(patches, touched, state)
    return delta.header
