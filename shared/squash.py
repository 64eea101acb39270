"""Compose consecutive deltas into one.

Without the base: XORs compose (``x1 ^ x2``), so do wrapping adds and overwrites (the later
wins), and a set mixed with an XOR or add composes where one side's positions cover the other's.
Otherwise :class:`NotSquashable` is raised, and :func:`squash_onto` (which holds the base
state) does it by applying the deltas and encoding the result against the base.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from .apply import flat_bits, make_patch
from .changes import UNSIGNED_NP
from .codec import DeltaFile, EncodedTensor, TensorChange, build_delta, save_delta, sparse_entry
from .errors import DeltaError


class NotSquashable(ValueError):
    pass


@dataclass
class _Sparse:
    mode: str  # "xor" | "set"
    positions: np.ndarray  # int64, sorted
    bits: np.ndarray  # unsigned


def _sparse(c: TensorChange, numel: int) -> _Sparse:
    pos = np.arange(numel, dtype=np.int64) if c.positions is None else c.positions.numpy()
    return _Sparse(c.mode, pos, c.bits.numpy().view(UNSIGNED_NP[c.bits.dtype]))


def _union(a: _Sparse, b: _Sparse, combine) -> _Sparse:
    pos = np.union1d(a.positions, b.positions)
    out = np.zeros(pos.shape[0], dtype=a.bits.dtype)
    ia, ib = np.searchsorted(pos, a.positions), np.searchsorted(pos, b.positions)
    out[ia] = a.bits
    out[ib] = combine(out[ib], b.bits)
    return _Sparse(a.mode, pos, out)


OPS = {"xor": np.bitwise_xor, "add": np.add}  # unsigned: add wraps like the bit patterns


def _compose(a: _Sparse, b: _Sparse) -> _Sparse:
    if a.mode == b.mode and a.mode in OPS:
        r = _union(a, b, OPS[a.mode])
        keep = r.bits != 0  # back where it started: unchanged after all
        return _Sparse(a.mode, r.positions[keep], r.bits[keep])
    if a.mode == b.mode == "set":
        return _union(a, b, lambda _, new: new)
    if a.mode == "set" and np.isin(b.positions, a.positions).all():
        return _union(a, b, OPS[b.mode])
    if b.mode == "set" and np.isin(a.positions, b.positions).all():
        return b
    raise NotSquashable(f"{a.mode} then {b.mode} over different positions needs the base")


def _compose_full(acc: TensorChange, c: TensorChange) -> TensorChange:
    full = acc.bits.clone()
    make_patch(c, flat_bits(full)).apply()
    return TensorChange(acc.name, "full", None, full)


def squash(files: list[DeltaFile]) -> bytes:
    """One delta equivalent to applying ``files`` in order (consecutive, same tensors)."""
    if not files:
        raise ValueError("nothing to squash")
    for prev, nxt in zip(files, files[1:]):
        if nxt.header.base_commitment != prev.header.commitment:
            raise DeltaError("out_of_order", f"v{nxt.header.version} does not follow v{prev.header.version}")
    first, last = files[0].header, files[-1].header
    if any(f.header.kind != "delta" for f in files):
        raise NotSquashable("only deltas squash")
    if any(e.positions == "classed" for f in files for e in f.header.tensors.values()):
        raise NotSquashable("positions coded against the base need the base: use squash_onto")
    encoded: dict[str, EncodedTensor] = {}
    for name, entry in last.tensors.items():
        acc: TensorChange | _Sparse | None = None
        for f in files:
            c = f.change(name)
            if c is None:
                continue
            if c.mode == "full":
                acc = c
                continue
            if isinstance(acc, TensorChange):
                acc = _compose_full(acc, c)
                continue
            s = _sparse(c, entry.numel)
            acc = s if acc is None else _compose(acc, s)
        encoded[name] = _encode(name, entry, acc)
    header, tensors = build_delta(encoded, version=last.version, base_version=first.base_version,
                                  base_commitment=first.base_commitment,
                                  base_state_digest=first.base_state_digest,
                                  via=_via(files))
    return save_delta(header, tensors)


def _encode(name: str, entry, acc) -> EncodedTensor:
    base = entry.model_copy(update={"encoding": "same", "changed": 0, "positions": None,
                                    "gap_bytes": 0, "coders": {}})
    if acc is None or (isinstance(acc, _Sparse) and acc.positions.size == 0):
        return EncodedTensor(base, {})
    if isinstance(acc, TensorChange):
        return EncodedTensor(base.model_copy(update={"encoding": "full", "changed": entry.numel}),
                             {name: acc.bits.contiguous()})
    return sparse_entry(base, name, acc.positions, acc.mode, acc.bits, int(acc.positions.size))


def _via(files: list[DeltaFile]) -> list[str]:
    return [s for f in files[:-1] for s in (*f.header.via, f.header.state_fingerprint)] + list(files[-1].header.via)


def squash_onto(base: dict, files: list[DeltaFile]) -> bytes:
    """One delta from ``base`` (the state the first file applies to) to the last file's state."""
    from .apply import apply_delta
    from .codec import encode_tensor

    first, last = files[0].header, files[-1].header
    touched = {c for f in files for c, e in f.header.tensors.items() if e.encoding != "same"}
    state = {n: (t.clone() if n in touched else t) for n, t in base.items()}
    for f in files:
        apply_delta(f, state)
    encoded = {n: encode_tensor(n, base[n], state[n], digest=last.tensors[n].digest,
                                fingerprint=last.tensors[n].fingerprint) for n in sorted(state)}
    header, tensors = build_delta(encoded, version=last.version, base_version=first.base_version,
                                  base_commitment=first.base_commitment,
                                  base_state_digest=first.base_state_digest, via=_via(files))
    return save_delta(header, tensors)
