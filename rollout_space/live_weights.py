"""The live weights of one engine rank, in checkpoint coordinates: stage, write, revert, audit.

An update is split so that generation stops only for the write:

* **stage** (while serving): parse and verify the delta (header checksum, base commitment and
  version, every blob's blake3), check that every tensor the delta leaves unchanged has the
  fingerprint this replica holds, map changed positions to engine parameters, gather the live bits
  there, compute the new bits with the codec's rule (``old ^ xor``, ``old + diff``, new values),
  and by default predict every touched tensor's fingerprint after the write from the held
  fingerprint and the old and new bits at the changed positions, in O(changes) (a tensor sent
  whole is checked on a scratch copy instead). Any failure here is a refusal and no weight has
  changed. blake3 digests are learnt from deltas that carry them (``digests="every"``) and
  unknown after one that does not, until the next dense load.
* **write** (paused): one ``index_copy_`` per (tensor, parameter) pair. Retrying is idempotent;
  an error part-way reverts what was written with one more ``index_copy_`` of the old bits.
* **audit** (serving again): read the written positions back (O(changes)) and compare with the
  bits written; the caller reverts on a mismatch. Then the **rolling audit**: the next slice of
  tensors read back whole from the engine and compared with what is held (the blake3 digest where
  it is known and the tensor is in host memory, else the fingerprint, on the device), so that
  every tensor is re-verified every ``audit_every`` versions (K); a mismatch there means the live
  weights were already not the held version, and the caller marks the replica damaged.

What the audit proves, exactly: the parameter objects this rank bound at start-up (and which are
still the model's registered parameters, on the same storage: :meth:`LiveWeights.unbound`) hold
the written bits at the written positions; staging proved those bits give the delta's target
fingerprints; the rolling audit proves, within K versions, that every tensor as a whole holds its
held digest or fingerprint (so a stray write elsewhere is caught then, not at once).
What it does not prove: that generation reads those parameters. A backend that computes from a
copy made at load time (oneDNN's packed CPU weights, a converted or quantized kernel layout, a
module caching a transposed weight) leaves its copy untouched by an in-place write, and reading
the parameter back then shows exactly the bits that were written: the audit passes while the
output is the old model's. Nor does it check every tensor's blake3 digest each version (the
rolling audit reaches each tensor every K versions; ``GET /weights/digest`` reads every tensor at
once), nor the prefix cache (the engine resets it with every write). Whether a write into a
parameter reaches the output is what the write-through probe checks
(:meth:`LiveWeights.perturbation`, ``RolloutEngine.write_probe``): it perturbs each parameter
through this same write path and requires a fixed prompt's logprobs to move, then restores it
and requires them back bit for bit.

Anchors and external checkpoints are dense: they go through the model's own ``load_weights``
and the whole live state digest is checked afterwards.

Under tensor parallelism each rank holds some tensors whole (norms, replicated on every rank) and
only part of the others (its shard). A whole tensor is checked on the rank as above. For a
tensor held in part, the rank keeps the fingerprint of its own elements at their checkpoint
indices, a partial sum; staging predicts the rank's next partial from the changes it holds and
reports it in ``Staged.shards`` with the delta's declared fingerprint, and the server requires
the ranks' partials to add up to it (:func:`check_shards`) before any rank writes. Its blake3
digest is the declared one (from the checkpoint or the delta); ``GET /weights/digest`` gathers
the tensor from every rank to recompute it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from shared.apply import Patch, check_base, landed
from shared.changes import INT_VIEW, map_balanced, map_batches
from shared.codec import DecodedBatch, DeltaFile, Header, TensorChange, TensorEntry, combine, holds
from shared.digest import TORCH_DTYPES, state_digest_from_entries, tensor_digest
from shared.digest import commitment as chain_step
from shared.errors import DeltaError
from shared.fingerprint import (Fingerprint, Gathered, GatherItem, GatherTarget, add_lanes, fingerprint_deltas,
                                gather_batch, gather_updates, one_run, state_fingerprint, tensor_fingerprint)

from .mapping import LiveMap


# Changed elements from which staging decodes and gathers, and the audit reads back, on the
# tensor threads. Their kernels run long enough between Python steps to gain from a second
# thread earlier than the work behind shared.changes.THREADS_FROM_CHANGES: 61M parameters in
# vLLM, medians of 16 alternating runs, serial against threaded: 11.7 against 14.8 ms at 0.1%
# changed (60k), 39.4 against 34.8 ms at 1% (610k); the read-back (30 each) 4.7 against 2.9 ms
# at 1%.
STAGE_THREADS_FROM = 1 << 18
DIGEST_PASSES = 3  # a live digest that writes interrupted this often holds the write lock for its last pass


@dataclass
class Held:
    """What this rank serves: the version, its commitment and every tensor's digest, declared
    fingerprint and live fingerprint (hex). ``declared``: the whole tensor's, as the checkpoint
    or the last delta that touched it says; ``fingerprints``: what this rank's elements add up
    to (the whole tensor's, except for a tensor held in part: the partial sum over its own
    elements). A digest is ``""`` when unknown: a delta published without digests touched the
    tensor since the last dense load (the fingerprints stay exact)."""

    version: int | None
    commitment: str
    digests: dict[str, str]
    specs: dict[str, tuple[str, list[int]]]
    fingerprints: dict[str, str] = field(default_factory=dict)
    declared: dict[str, str] = field(default_factory=dict)

    def copy(self) -> Held:
        return Held(self.version, self.commitment, dict(self.digests), self.specs, dict(self.fingerprints),
                    dict(self.declared))

    @property
    def state_digest(self) -> str:
        """The blake3 state digest, or "" while some tensor's digest is unknown."""
        return state_digest_from_entries({n: (d, s, self.digests[n]) for n, (d, s) in self.specs.items()})

    @property
    def state_fingerprint(self) -> str:
        return state_fingerprint({n: (d, s, self.declared[n]) for n, (d, s) in self.specs.items()})


@dataclass
class Staged:
    header: Header
    patches: list[Patch]
    changed: int
    shards: dict[str, tuple[str, str]] = field(default_factory=dict)  # held in part: (partial after, declared)
    previous: Held | None = None
    written: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def touched(self) -> list[str]:
        return sorted({p.name for p in self.patches})


class Piece(NamedTuple):
    """One engine parameter's part of a touched tensor's change, staged."""

    patch: Patch
    positions: torch.Tensor | None  # checkpoint positions (None: every element)
    old: torch.Tensor  # checkpoint bits there, before and after the write
    new: torch.Tensor
    lanes: np.ndarray | None = None  # what the write adds to the tensor's fingerprint, if gathered with it


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def _gathered_piece(name: str, where: GatherTarget, g: Gathered) -> list[Piece]:
    """A gathered change as its one piece, or none where this rank holds none of it."""
    return [Piece(Patch(name, where.target, g.dest, g.new, g.old), g.positions, g.old, g.new, g.lanes)] \
        if g.dest.numel() else []


class LiveWeights:
    def __init__(self, model: torch.nn.Module, live: LiveMap, specs: Mapping[str, tuple[str, list[int]]],
                 digests: Mapping[str, str], fingerprints: Mapping[str, str] | None = None, *, audit_every: int = 8):
        """``digests``/``fingerprints``: from the checkpoint, of the tensors the engine does not
        hold whole (fingerprints: whole-tensor ones); the others are read back from the engine
        (:meth:`read_back`). ``audit_every``: K, the rolling audit's period in versions."""
        if audit_every < 1:
            raise ValueError(f"audit_every must be >= 1, not {audit_every}")
        self.model, self.live = model, live
        self.held = Held(None, "", dict(digests), dict(specs), dict(fingerprints or {}), dict(fingerprints or {}))
        self.audit_every = audit_every
        self._audit_order = sorted(live.map.tensors)
        self._audit_next = 0
        self._gather_at: dict[str, GatherTarget | None] = {}  # see _target

    # ------------------------------------------------------------------ reading
    def digest(self, name: str) -> str:
        return tensor_digest(self.live.read(name))

    def fingerprint(self, name: str) -> str:
        """The tensor's fingerprint read back from the engine (on the device that holds it); of
        this rank's elements only, for a tensor it holds in part."""
        return self.live.fingerprint(name).hex()

    def live_hashes(self, names: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
        """Digests and fingerprints of tensors the engine holds, each tensor read back once (no
        digest for a tensor held in part: it takes every rank's elements)."""
        digests, fps = {}, {}
        for n in names:
            if not self.live.whole(n):
                fps[n] = self.fingerprint(n)
                continue
            t = self.live.read(n)
            digests[n], fps[n] = tensor_digest(t), tensor_fingerprint(t).hex()
        return digests, fps

    def split(self) -> list[str]:
        """The tensors this rank holds in part (none on a single rank)."""
        return [n for n in self.live.map.tensors if not self.live.whole(n)]

    def read_back(self) -> None:
        """Held digests and fingerprints from the live weights, for every tensor the engine holds
        (digests and declared fingerprints of tensors held in part stay the checkpoint's)."""
        digests, fps = self.live_hashes(self.live.map.tensors)
        self.held.digests.update(digests)
        self.held.fingerprints.update(fps)
        self.held.declared.update({n: fp for n, fp in fps.items() if n in digests})

    def hash_against(self, name: str, held_digest: str) -> tuple[str, str | None]:
        """:func:`audit_hashes` of a tensor this rank holds whole, read back from the engine."""
        return audit_hashes(self.live.read(name), held_digest)

    def live_digests(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """Digests read back from the engine (mapped tensors; ignored ones keep the held digest)."""
        names = list(self.held.specs) if names is None else list(names)
        out = {}
        for n in names:
            out[n] = self.digest(n) if n in self.live.map.tensors else self.held.digests[n]
        return out

    def live_state_digest(self) -> str:
        d = self.live_digests()
        return state_digest_from_entries({n: (dt, s, d[n]) for n, (dt, s) in self.held.specs.items()})

    # ------------------------------------------------------------------ sparse path
    def check(self, header: Header) -> None:
        """Refuse, before touching anything, a delta that does not fit what this rank holds."""
        if header.kind != "delta":
            raise DeltaError("format", f"v{header.version} is an anchor; load it densely")
        check_base(header, version=self.held.version, commitment=self.held.commitment,
                   state_digest=None)
        names = set(header.tensors)
        if names != set(self.held.specs):
            diff = sorted(names ^ set(self.held.specs))
            raise DeltaError("shape_mismatch", f"delta and replica name different tensors: {diff[:3]}")
        for name, e in header.tensors.items():
            dtype, shape = self.held.specs[name]
            if e.dtype != dtype or e.shape != shape:
                raise DeltaError("shape_mismatch", f"{name}: delta says {e.dtype}{e.shape}, "
                                 f"replica holds {dtype}{shape}")
            if e.encoding == "same" and e.fingerprint != self.held.declared[name]:
                raise DeltaError("wrong_base", f"{name}: delta keeps fingerprint {e.fingerprint[:12]}…, "
                                 f"replica holds {self.held.declared[name][:12]}…")
            if e.encoding != "same" and name not in self.live.map.tensors and not any(
                    o.fingerprint == e.fingerprint and o.shape == e.shape and n in self.live.map.tensors
                    for n, o in header.tensors.items()):
                # A tensor the loader writes nowhere (a tied LM head listed in the checkpoint)
                # may change only to the value of a tensor the engine holds: the tie carries it.
                raise DeltaError("shape_mismatch", f"{name} changes but the engine does not hold it")

    def stage(self, delta: DeltaFile, *, predict: bool = True, bases: Mapping[str, torch.Tensor] | None = None
              ) -> Staged:
        """Decode (one numba call per batch of tensors) and gather, on the tensor threads from
        :data:`STAGE_THREADS_FROM` changes on (the kernels release the GIL, and a gather waits on
        memory, which a second thread overlaps), then predict every touched tensor's fingerprint.
        The tensors held in a CPU parameter are gathered in one numba call per batch that also
        gives their fingerprint changes (:meth:`_pieces`); the others through torch (any device),
        their fingerprint changes in one call for all.
        ``timings``: ``stage_s`` is wall time; ``decode_s`` and ``gather_s`` are summed over the
        threads. ``bases``: the live bits of tensors split across ranks whose positions are coded
        against the base (put together by the server), which this rank cannot read itself."""
        t0 = time.perf_counter()
        read = (lambda n: bases[n] if n in bases else self.live.read(n)) if bases else self.live.read
        header = delta.header
        self.check(header)
        delta.verify()  # once, before the threads decode
        names = [n for n, e in header.tensors.items()
                 if e.encoding != "same" and n in self.live.map.tensors]  # a tie alias is checked above
        times: list[tuple[float, float]] = []  # (decode, gather) per batch

        def batch(members: list[str]) -> list[tuple[list[Piece], bool]]:
            with torch.no_grad():  # per thread
                a = time.perf_counter()
                decoded, single = delta.decode_batches(members, base=read)
                b = time.perf_counter()
                pieces = self._pieces(decoded, list(single.values()))
            times.append((b - a, time.perf_counter() - b))
            return [pieces[n] for n in members]

        staged = map_batches(batch, names, [header.tensors[n].changed for n in names],
                             serial_below=STAGE_THREADS_FROM)
        patches: list[Patch] = []
        pending: list[tuple[str, list[Piece]]] = []  # tensors whose fingerprint after the write is predicted
        t_predict = 0.0
        with torch.no_grad():
            for name, (pieces, listed) in zip(names, staged):
                patches += [p.patch for p in pieces]
                # a tensor held in part: its held partial must follow, predict or not
                if not self.live.whole(name) or predict and listed and self.held.fingerprints.get(name):
                    pending.append((name, pieces))
                elif predict:  # sent whole, or no fingerprint held: by a scratch copy
                    a = time.perf_counter()
                    self._predict_whole(name, pieces, header.tensors[name])
                    t_predict += time.perf_counter() - a
            a = time.perf_counter()
            shards = self._predict(header, pending)
            t_predict += time.perf_counter() - a
        changed = sum(header.tensors[n].changed for n in names)
        return Staged(header, patches, changed, shards, timings={
            "decode_s": sum(d for d, _ in times), "gather_s": sum(g for _, g in times), "predict_s": t_predict,
            "stage_s": time.perf_counter() - t0})

    def _pieces(self, decoded: list[DecodedBatch], single: list[TensorChange]
                ) -> dict[str, tuple[list[Piece], bool]]:
        """Each change's pieces, and whether its changed positions are listed, each in one piece
        (so the fingerprint after the write follows from the pieces). The tensors this rank holds
        in one CPU parameter in the checkpoint's dtype (all of them on one rank; under tensor
        parallelism, a shard as one run or a run per row) are gathered with their fingerprint
        changes: a decoded batch of them in one numba call
        (:func:`~shared.fingerprint.gather_batch`), the other changes per element width
        (:func:`~shared.fingerprint.gather_updates`). The rest go through torch, a piece per
        parameter."""
        out: dict[str, tuple[list[Piece], bool]] = {}
        for batch in decoded:
            targets = [self._target(n) for n in batch.names]
            if all(t is not None for t in targets):
                gathered = gather_batch(targets, batch.modes, batch.positions, batch.bits, batch.bounds)
                out.update((n, (_gathered_piece(n, t, g), True)) for n, t, g in zip(batch.names, targets, gathered))
            else:
                single = single + batch.changes()
        items: dict[int, list[tuple[str, GatherItem]]] = {}  # by element size
        for change in single:
            where = self._target(change.name) if change.positions is not None and change.mode != "full" else None
            if where is None:
                pieces = self._patches_for(change)
                out[change.name] = pieces, self._listed(change, pieces)
            else:
                items.setdefault(where.size, []).append(
                    (change.name, GatherItem(where, change.positions, change.bits, change.mode)))
        for run in items.values():
            out.update((n, (_gathered_piece(n, item.where, g), True))
                       for (n, item), g in zip(run, gather_updates([item for _, item in run])))
        return out

    def _target(self, name: str) -> GatherTarget | None:
        """Where a change to ``name`` is gathered from, if this rank holds it in one CPU parameter
        of the checkpoint's dtype: its own view where it is one run of it, else the parameter.
        Kept: the same tensors are staged every version."""
        if name in self._gather_at:
            return self._gather_at[name]
        tables, dtype = self.live.run_tables(name), TORCH_DTYPES[self.held.specs[name][0]]
        flat = self.live.flats[tables[0][0]] if len(tables) == 1 else None
        where = None
        if flat is not None and flat.is_cpu and flat.dtype == dtype and flat.element_size() <= 4:
            numel = self.live.map.tensors[name].numel
            (start, length, offset), *more = tables[0][1].tolist()
            if not more and start == 0 and length == numel:  # the tensor is one run: its own view
                where = GatherTarget(_bits(flat)[offset:offset + numel], one_run(numel), numel)
            else:
                where = GatherTarget(_bits(flat), torch.from_numpy(tables[0][1]), numel)
        self._gather_at[name] = where
        return where

    def _patches_for(self, change: TensorChange) -> list[Piece]:
        """The change's pieces through torch, one per engine parameter this rank holds of it."""
        ck_dtype = TORCH_DTYPES[self.held.specs[change.name][0]]
        full = change.bits.reshape(-1) if change.mode == "full" else None
        if full is not None:
            full = _bits(full)
        out = []
        for pl in self.live.locate(change.name, change.positions):  # only what this rank holds
            flat = self.live.flats[pl.param]
            dev = flat.device  # on GPU, indices and bits move over while serving, not in the pause
            same = flat.dtype == ck_dtype
            target = _bits(flat) if same else flat
            dest = pl.dest.to(dev)
            old = target.index_select(0, dest)
            old_ck = old if same else _bits(old.to(ck_dtype))
            if full is not None:
                new_ck = (full if pl.select is None else full[pl.select]).to(dev)
            else:
                bits = (change.bits if pl.select is None else change.bits[pl.select]).to(dev)
                new_ck = combine(change.mode, old_ck, bits)  # the codec's own rule (xor, add, set)
            new = new_ck if same else new_ck.view(ck_dtype).to(flat.dtype)
            positions = change.positions
            if pl.select is not None:
                positions = (positions[pl.select] if positions is not None else pl.select)
            if positions is not None:
                positions = positions.to(dev)
            out.append(Piece(Patch(change.name, target, dest, new.contiguous(), old), positions, old_ck, new_ck))
        return out

    @staticmethod
    def _listed(change: TensorChange, pieces: list[Piece]) -> bool:
        """Whether the changed positions are listed and (``locate`` splits them between
        parameters, so the pieces never overlap) each lies in one piece."""
        return change.positions is not None and all(p.positions is not None for p in pieces) and \
            sum(p.positions.numel() for p in pieces) == change.positions.numel()

    def _predict(self, header: Header, pending: list[tuple[str, list[Piece]]]) -> dict[str, tuple[str, str]]:
        """Check, without writing, that the write gives each pending tensor the delta's declared
        fingerprint: the held one plus what the old and new bits at the changed positions add
        (O(changes); pieces not gathered with their fingerprint change take one numba call for
        all of them). For a tensor this rank holds in part that is this rank's partial, returned
        as ``{name: (partial after, declared)}`` for the server to add up over ranks."""
        rest = [(p.positions, p.old, p.new, TORCH_DTYPES[header.tensors[name].dtype].itemsize * 8)
                for name, pieces in pending for p in pieces if p.lanes is None]
        adds = iter(np.array(fp.lanes, dtype=np.uint64) for fp in fingerprint_deltas(rest))
        lanes = np.zeros((len(pending), 4), dtype=np.uint64)
        for row, (_, pieces) in zip(lanes, pending):
            for p in pieces:
                row += next(adds) if p.lanes is None else p.lanes  # uint64 wraps mod 2**64
        after = add_lanes([self.held.fingerprints[name] for name, _ in pending], lanes)
        shards = {}
        for (name, _), fp in zip(pending, after):
            declared = header.tensors[name].fingerprint
            if not self.live.whole(name):
                shards[name] = (fp, declared)
            elif fp != declared:
                raise DeltaError("digest_mismatch", f"{name}: applying would not give the declared "
                                 "fingerprint (wrong base or damaged delta); nothing written")
        return shards

    def _predict_whole(self, name: str, pieces: list[Piece], entry: TensorEntry) -> None:
        ck_dtype = TORCH_DTYPES[self.held.specs[name][0]]
        after = self.live.read(name).reshape(-1).clone()
        bits = _bits(after)
        for _, positions, _, new_ck, _ in pieces:
            if positions is None:
                bits.copy_(new_ck.view(bits.dtype) if new_ck.dtype != bits.dtype else new_ck)
            else:
                bits.index_copy_(0, positions, new_ck)
        if after.dtype != ck_dtype:
            after = after.to(ck_dtype)
        if not holds(entry, after):
            raise DeltaError("digest_mismatch", f"{name}: applying would not give the "
                             "declared digest (wrong base or damaged delta); nothing written")

    def write(self, staged: Staged) -> float:
        """Write; on an error part-way, undo what was written and re-raise. Returns seconds."""
        t0 = time.perf_counter()
        done: list[Patch] = []
        with torch.no_grad():
            try:
                for p in staged.patches:
                    p.apply()
                    done.append(p)
            except BaseException:
                for p in reversed(done):
                    p.revert()
                raise
            if staged.patches and staged.patches[0].target.is_cuda:
                torch.cuda.synchronize()  # the pause ends when the writes have landed
        dt = time.perf_counter() - t0
        staged.previous = self.held.copy()
        h = staged.header
        for name, e in h.tensors.items():
            self.held.digests[name] = e.digest or (self.held.digests[name] if e.encoding == "same" else "")
            self.held.declared[name] = e.fingerprint
            if name in staged.shards:
                self.held.fingerprints[name] = staged.shards[name][0]
            elif name not in self.live.map.tensors or self.live.whole(name):  # else: a partial, unchanged
                self.held.fingerprints[name] = e.fingerprint
        self.held.version, self.held.commitment = h.version, h.commitment
        staged.written = True
        staged.timings["write_s"] = dt
        return dt

    def revert(self, staged: Staged) -> float:
        t0 = time.perf_counter()
        if staged.written:
            with torch.no_grad():
                for p in reversed(staged.patches):
                    p.revert()
            assert staged.previous is not None
            self.held = staged.previous
            staged.written = False
        return time.perf_counter() - t0

    def audit(self, staged: Staged) -> list[str]:
        """Touched tensors whose written positions read back other bits than were written, or
        whose engine parameter is no longer the model's (empty: the bits landed in the parameters;
        see the module docstring for what this does not prove). O(changes)."""
        unbound = set(self.unbound())
        held = map_batches(landed, staged.patches, [p.new.numel() for p in staged.patches],
                           serial_below=STAGE_THREADS_FROM)
        bad = {p.name for p, ok in zip(staged.patches, held) if not ok}
        for n in staged.touched:
            params = {self.live.map.params[i].name for i in self.live.map.tensors[n].param}
            if params & unbound:
                bad.add(n)
        return sorted(bad)

    def rolling_audit(self) -> tuple[list[str], list[str]]:
        """The next slice of tensors (every tensor once per ``audit_every`` calls): (audited,
        those whose live bits are not the held ones)."""
        order = self._audit_order
        if not order:
            return [], []
        k = -(-len(order) // self.audit_every)
        names = [order[(self._audit_next + i) % len(order)] for i in range(min(k, len(order)))]
        self._audit_next = (self._audit_next + k) % len(order)
        held = map_balanced(self._holds, names, [self.live.map.tensors[n].numel for n in names])
        return names, [n for n, ok in zip(names, held) if not ok]

    def _holds(self, name: str) -> bool:
        """Whether the engine's copy of a tensor is the held one, read back whole: by its blake3
        digest where that is known and the tensor lies whole in host memory (blake3 reads ~4x
        faster than the fingerprint's multiplies on a CPU core: 24 against 99 ms for 61M bf16
        elements), else by its fingerprint, on the device that holds it (a partial one for a
        tensor held in part)."""
        digest = self.held.digests.get(name)
        if digest and self.live.whole(name):
            t = self.live.read(name)
            if t.is_cpu:
                return tensor_digest(t) == digest
        return self.fingerprint(name) == self.held.fingerprints.get(name)

    # ------------------------------------------------------------------ write-through probe
    def unbound(self) -> list[str]:
        """Engine parameters the map writes into that the model no longer holds as bound at
        start-up (replaced by another parameter, or its data moved to other storage): writes and
        reads through the map would miss what the model computes with."""
        registered = dict(self.model.named_parameters(remove_duplicate=False))  # one walk, not one per name
        out = []
        for spec, param, flat in zip(self.live.map.params, self.live.params, self.live.flats):
            now = registered.get(spec.name)
            if now is not param or now.data.data_ptr() != flat.data_ptr():
                out.append(spec.name)
        return out

    def probe_targets(self) -> list[dict]:
        """Engine parameters the map writes into (the ones a delta can change), in map order,
        with the checkpoint tensors each holds (in the order they sit in it) and how many elements."""
        out: dict[int, dict] = {}
        where: dict[int, dict[str, int]] = {}  # param -> checkpoint tensor -> its first offset there
        for name, t in self.live.map.tensors.items():
            for p, ps, n in zip(t.param, t.param_start, t.length):
                e = out.setdefault(p, {"param": self.live.map.params[p].name, "tensors": [], "elements": 0})
                e["elements"] += n
                first = where.setdefault(p, {})
                first[name] = min(ps, first.get(name, ps))
        for p, e in out.items():
            e["tensors"] = sorted(where[p], key=where[p].get)
        return [out[p] for p in sorted(out)]

    def perturbation(self, param: str) -> Patch:
        """A write through the delta's own path (a :class:`Patch`: ``index_copy_`` of bits into
        the parameter's storage, undone by one more) that must move the output if the parameter
        reaches it: every element the map places in ``param`` becomes ``-2 w - m`` (m: mean |w|,
        1 where all are zero). Not a scale (norms after a projection would cancel it) and not a
        plain sign flip (zeros, and q/k flipped together, would not show)."""
        index = next((i for i, s in enumerate(self.live.map.params) if s.name == param), None)
        if index is None:
            raise DeltaError("format", f"{param} is not an engine parameter the map writes into")
        runs = [(ps, n) for t in self.live.map.tensors.values()
                for q, ps, n in zip(t.param, t.param_start, t.length) if q == index]
        flat = self.live.flats[index]
        dest = torch.cat([torch.arange(ps, ps + n, dtype=torch.int64) for ps, n in runs]).to(flat.device)
        target = _bits(flat)
        with torch.no_grad():
            w = flat.index_select(0, dest).float()
            m = w.abs().mean().item() or 1.0
            new = _bits((-2.0 * w - m).to(flat.dtype))
            old = target.index_select(0, dest)
        return Patch(f"probe:{param}", target, dest, new.contiguous(), old)

    # ------------------------------------------------------------------ dense path
    def load_dense(self, files: list[Path], *, version: int, commitment: str, state_digest: str,
                   header: Header | None = None) -> dict:
        """Load full checkpoint files through ``load_weights``, then check the live state digest.
        Returns timings and ``shards``: per tensor held in part, (live partial, the file's
        fingerprint), for the server's :func:`check_shards`.

        On a mismatch the engine holds weights of no version: ``held`` is marked unknown
        (version None, empty commitment) and the caller must re-sync before serving.
        """
        from safetensors import safe_open

        t0 = time.perf_counter()
        split = set(self.split())
        file_digests: dict[str, str] = {}  # tensors not read back whole from the engine: from the file
        file_fps: dict[str, str] = {}
        with torch.no_grad():
            for f in files:
                with safe_open(str(f), framework="pt") as fh:
                    names = [n for n in fh.keys() if n in self.held.specs]
                    for n in names:
                        if n not in self.live.map.tensors or n in split:
                            t = fh.get_tensor(n)
                            file_digests[n], file_fps[n] = tensor_digest(t), tensor_fingerprint(t).hex()
                    self.model.load_weights((n, fh.get_tensor(n)) for n in names
                                            if n in self.live.map.tensors)
        t_load = time.perf_counter() - t0
        if unbound := self.unbound():  # the loader replaced a parameter: the map reads stale storage
            self.held = Held(None, "", dict(self.held.digests), self.held.specs, dict(self.held.fingerprints),
                             dict(self.held.declared))
            raise DeltaError("digest_mismatch", f"after loading v{version} densely, {unbound[0]} is no "
                             "longer the parameter this replica writes into")
        mapped = [n for n in self.held.specs if n in self.live.map.tensors]
        digests, fps = self.live_hashes(mapped)
        shards = {n: (fps[n], file_fps.get(n, "")) for n in split}
        declared = {n: fp for n, fp in fps.items() if n not in split}
        for n in self.held.specs:
            if n not in digests:
                digests[n] = file_digests.get(n) or (header.tensors[n].digest if header else "")
            if n not in declared:
                declared[n] = file_fps.get(n) or (header.tensors[n].fingerprint if header else "")
            fps.setdefault(n, declared[n])
        sd = state_digest_from_entries({n: (d, s, digests[n]) for n, (d, s) in self.held.specs.items()})
        if sd != state_digest:
            self.held = Held(None, "", digests, self.held.specs, fps, declared)
            raise DeltaError("digest_mismatch", f"after loading v{version} densely the live state "
                             f"digest is {sd[:12]}…, expected {state_digest[:12]}…")
        self.held = Held(version, commitment, digests, self.held.specs, fps, declared)
        return {"load_s": t_load, "verify_s": time.perf_counter() - t0 - t_load, "shards": shards}

    def adopt(self, *, version: int, commitment: str, state_digest: str) -> None:
        """Declare the weights already loaded to be ``version`` (an external genesis anchor that
        is the model this engine started from), after checking the state digest."""
        if self.held.state_digest != state_digest:
            raise DeltaError("wrong_base", f"v{version} has state digest {state_digest[:12]}…, the "
                             f"loaded model has {self.held.state_digest[:12]}…")
        self.held.version, self.held.commitment = version, commitment


def check_shards(per_rank: list[Mapping[str, tuple[str, str] | list[str]]]) -> list[str]:
    """Tensors whose ranks' partial fingerprints do not add up to the expected whole (sorted).

    ``per_rank``: each rank's ``{name: (partial, expected)}`` for the tensors it holds in part.
    A tensor some rank holds whole is checked on that rank and never listed here; one that two
    ranks hold overlapping parts of cannot add up, and is listed too."""
    total: dict[str, Fingerprint] = {}
    expected: dict[str, set[str]] = {}
    for shards in per_rank:
        for name, (partial, want) in shards.items():
            total[name] = total.get(name, Fingerprint()) + Fingerprint.from_hex(partial)
            expected.setdefault(name, set()).add(want)
    return sorted(n for n, fp in total.items() if expected[n] != {fp.hex()})


def audit_hashes(t: torch.Tensor, held_digest: str) -> tuple[str, str | None]:
    """A whole tensor's blake3 digest and, unless it is the held digest (which then settles it),
    its fingerprint: the full audit's answer per tensor (:func:`compare_live`)."""
    d = tensor_digest(t)
    return d, None if d == held_digest else tensor_fingerprint(t).hex()


def compare_live(specs: Mapping[str, tuple[str, list[int]]], held_digests: Mapping[str, str],
                 declared: Mapping[str, str], live: Mapping[str, tuple[str, str | None]]) -> dict:
    """A full audit's verdict: the live state digest and fingerprint, and the tensors that are
    not what is held. ``live``: per tensor read back, (blake3 digest, fingerprint or None when
    the digest is the held one); a tensor not read (not held by the engine) counts as held.
    A tensor whose digest is known must match it; one whose digest is unknown (touched by deltas
    published without digests) must match its declared fingerprint."""
    digests, fps, bad = {}, {}, []
    for n in specs:
        d, fp = live.get(n, (held_digests[n], None))
        fp = declared[n] if fp is None else fp
        if (d != held_digests[n]) if held_digests[n] else (fp != declared[n]):
            bad.append(n)
        digests[n], fps[n] = d, fp
    return {"state_digest": state_digest_from_entries({n: (t, s, digests[n]) for n, (t, s) in specs.items()}),
            "state_fingerprint": state_fingerprint({n: (t, s, fps[n]) for n, (t, s) in specs.items()}),
            "mismatched": sorted(bad)}


def genesis_commitment(state_fingerprint: str) -> str:
    return chain_step("", state_fingerprint)
