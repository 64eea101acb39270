"""Compose consecutive deltas into one, without the base.

XOR composes without the base (``x1 ^ x2``), and so do overwrites (the later wins). A set
followed by an XOR, or an XOR followed by a set, composes only where one side's positions cover
the other's; otherwise the tensor cannot be squashed and the caller keeps the deltas apart.
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


def _compose(a: _Sparse, b: _Sparse) -> _Sparse:
    if a.mode == b.mode == "xor":
        r = _union(a, b, np.bitwise_xor)
        keep = r.bits != 0  # flipped back: unchanged after all
        return _Sparse("xor", r.positions[keep], r.bits[keep])
    if a.mode == b.mode == "set":
        return _union(a, b, lambda _, new: new)
    if a.mode == "set" and np.isin(b.positions, a.positions).all():
        return _union(a, b, np.bitwise_xor)
    if a.mode == "xor" and np.isin(a.positions, b.positions).all():
        return b
    raise NotSquashable("a set and an XOR over different positions need the base to compose")


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
                                  via=[s for f in files[:-1] for s in (*f.header.via, f.header.state_digest)]
                                  + list(last.via))
    return save_delta(header, tensors)


def _encode(name: str, entry, acc) -> EncodedTensor:
    base = entry.model_copy(update={"encoding": "same", "changed": 0, "positions": None,
                                    "gap_bytes": 0, "blobs": {}})
    if acc is None or (isinstance(acc, _Sparse) and acc.positions.size == 0):
        return EncodedTensor(base, {})
    if isinstance(acc, TensorChange):
        return EncodedTensor(base.model_copy(update={"encoding": "full", "changed": entry.numel}),
                             {name: acc.bits.contiguous()})
    return sparse_entry(base, name, acc.positions, {acc.mode: lambda _: acc.bits}, int(acc.positions.size))
