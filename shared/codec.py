"""The delta file format: exact sparse changes between two bf16 states, as one safetensors file.

A file is either an *anchor* (every tensor in full, under its checkpoint name, so an anchor is
also a loadable checkpoint) or a *delta*. In a delta each changed tensor ``name`` is stored as
``U8`` blobs:

* ``name::pos``: the changed flat C-order positions as gaps (``pos[i] - pos[i-1] - 1``, the
  first from -1): a Rice code, or little-endian ``gap_bytes`` wide in byte planes under zstd.
  Absent when ``positions == "all"`` (every element is sent: the writer does that where more
  than half of them changed).
* ``name::val``: what changed at those positions, in the kind that is smallest for this tensor
  (``encoding``): the XOR of old and new bits (``"xor"``), the wrapping integer difference of the
  bit patterns (``"add"``; a one-ulp step is +-1), both applied once onto the exact base, or the
  new bits (``"set"``, idempotent).

Each blob's ``coders[suffix]`` says how it is compressed: ``"rice"`` (gaps), ``"ans"`` (rANS with
a table fitted to the blob) or ``"zstd"`` over byte planes; see :mod:`shared.entropy`.

Tensors of other dtypes that changed are stored whole under their own name (``"full"``).
The safetensors metadata key ``deltasync`` holds a JSON :class:`Header` (checksummed by
``deltasync_blake3``): versions, base and target commitments, state fingerprints and state
digests and, for every tensor, its dtype, shape, fingerprint, digest, change count, encoding
and coders; ``payload_blake3`` covers every blob, so damage anywhere in the file is found before
any weight changes.

Identity is the fingerprint (:mod:`shared.fingerprint`): a tensor's target fingerprint follows
from its base fingerprint and the old and new bits at the changed positions alone, so a writer
and a replica both get it in O(changes), and a version's commitment binds its state fingerprint
(:func:`chain_commitment`). blake3 digests (whole tensors, O(model)) are always in an anchor and
optional in a delta: an entry's ``digest`` is ``""`` when its writer did not compute it, and the
header's ``state_digest`` is ``""`` unless every entry has one.

The header's JSON text starts with its ``format_version``. Format history: 1 had no
fingerprints; 2 added them but chained commitments over blake3 state digests, so every delta
needed every touched tensor hashed whole; 3 chains them over state fingerprints. Versions 1
and 2 left the version out of the text (it was the default); their files are refused with a
message saying so. 4 codes the frequency table of an ``"ans"`` blob in the blob's own bits
(:func:`shared.kernels.table_code`: ~9 bytes for the few symbols of one-ulp steps) instead of a
zstd frame (~25 bytes there, ~6 us a blob to make); files of format 3 are still read.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import blake3
import numpy as np
import safetensors
import safetensors.torch
import torch
from pydantic import BaseModel, ValidationError

from . import buffers
from .changes import (INT_VIEW, SIGNED_NP, THREADS_FROM_CHANGES, UNSIGNED_NP, Changes, find_changes,
                      map_balanced, map_batches, unsigned_view)
from .entropy import (
    ALPHABET,
    TableCoding,
    decode_ints_into,
    encode_ints,
    ints_sections_many,
    rice_decode,
    rice_encode,
    zstd_compress,
    zstd_decompress,
)
from .digest import (
    TORCH_DTYPES,
    commitment,
    dtype_name,
    raw_bytes,
    state_digest,
    state_digest_from_entries,
    tensor_digest,
)
from .errors import DeltaError
from .fingerprint import (Fingerprint, add_lanes, delta_lanes, fingerprint_delta, state_fingerprint,
                          tensor_fingerprint)
from .fingerprint import fingerprints as fingerprints_of

FORMAT = "deltasync"
_HEX = re.compile("[0-9a-f]*")
FORMAT_VERSION = 4  # 4: rANS tables in Elias-gamma codes, not zstd frames
# How the formats this deltasync reads code the tables of their "ans" blobs (shared.entropy)
ANS_TABLES: dict[int, TableCoding] = {3: "zstd", 4: "gamma"}
POS, VAL = "::pos", "::val"
# (shift, mask) of the exponent field in each float dtype's bits: the class of an element
EXPONENT = {torch.bfloat16: (7, 0xFF), torch.float16: (10, 0x1F), torch.float32: (23, 0xFF)}
_CLASSED = struct.Struct("<BII")  # class, changes in it, bytes of its Rice code

Encoding = Literal["same", "xor", "add", "set", "full"]


class TensorEntry(BaseModel):
    dtype: str
    shape: list[int]
    digest: str = ""  # blake3 tensor digest of the target ("": not computed; always set in an anchor)
    fingerprint: str = ""  # tensor fingerprint of the target (always set in a file)
    changed: int = 0
    encoding: Encoding = "same"
    positions: Literal["gaps", "classed", "all"] | None = None
    gap_bytes: int = 0
    coders: dict[str, Literal["zstd", "ans", "rice"]] = {}  # blob suffix -> how it is compressed

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Header(BaseModel):
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    kind: Literal["anchor", "delta"]
    version: int
    base_version: int | None = None
    base_commitment: str = ""
    base_state_digest: str = ""  # lets a plain checkpoint (no commitment) be checked as the base
    commitment: str
    state_fingerprint: str  # of the target, from the entries' fingerprints
    state_digest: str = ""  # from the entries' digests when every entry has one, else ""
    # State fingerprints of the versions a squashed delta skips over, oldest first: the
    # commitment chains through them, so it stays verifiable from the header alone.
    via: list[str] = []
    payload_blake3: str = ""  # over every blob, so damage is found before any weight changes
    tensors: dict[str, TensorEntry]

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.tensors.values())

    @property
    def changed(self) -> int:
        return sum(e.changed for e in self.tensors.values())

    @property
    def dense_bytes(self) -> int:
        return sum(e.numel * TORCH_DTYPES[e.dtype].itemsize for e in self.tensors.values())


def entries_digest(entries: Mapping[str, TensorEntry]) -> str:
    """The state digest a header's tensor entries add up to ("" if some entry has no digest)."""
    return state_digest_from_entries({n: (e.dtype, e.shape, e.digest) for n, e in entries.items()})


def entries_fingerprint(entries: Mapping[str, TensorEntry]) -> str:
    """The state fingerprint a header's tensor entries add up to."""
    return state_fingerprint({n: (e.dtype, e.shape, e.fingerprint) for n, e in entries.items()})


def chain_commitment(base_commitment: str, state_fingerprints: list[str]) -> str:
    """The commitment after one version per state fingerprint (several: a squashed delta's)."""
    c = base_commitment
    for sf in state_fingerprints:
        c = commitment(c, sf)
    return c


# --------------------------------------------------------------------------- byte planes


def _to_planes(a: np.ndarray) -> np.ndarray:
    """Every element's bytes grouped plane by plane (low bytes first): similar bytes sit together,
    which is what makes small XORs and small gaps compress well."""
    from .kernels import split_planes

    raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).view(np.uint8)
    out = np.empty(raw.shape[0], dtype=np.uint8)
    split_planes(raw, a.itemsize, out)
    return out


def _gap_planes(positions: np.ndarray) -> tuple[bytes, int]:
    from .kernels import gap_planes

    planes, nbytes = gap_planes(positions)
    return zstd_compress(planes), nbytes


def encode_positions(positions: np.ndarray) -> tuple[bytes, int, str]:
    """Gaps between positions as a Rice code (near the entropy when changes are spread out) or
    zstd'd byte planes (better when they cluster), whichever is smaller. zstd is tried only
    where :func:`_zstd_may_win`, and with more than :data:`SAMPLE` changes decided on the first
    ones, so that only the winner is computed in full."""
    rice = rice_encode(positions, running=True)
    if not _zstd_may_win(positions, len(rice)):
        return rice, 0, "rice"
    return _zstd_trial(positions, rice)


def _zstd_trial(positions: np.ndarray, rice: bytes) -> tuple[bytes, int, str]:
    """:func:`encode_positions` where zstd may win: the smaller of the Rice code ``rice`` and
    the zstd'd gap planes."""
    if positions.shape[0] > SAMPLE:
        if len(rice_encode(positions[:SAMPLE], running=True)) <= len(_gap_planes(positions[:SAMPLE])[0]):
            return rice, 0, "rice"
        return (*_gap_planes(positions), "zstd")
    zstd_blob, nbytes = _gap_planes(positions)
    return (rice, 0, "rice") if len(rice) < len(zstd_blob) else (zstd_blob, nbytes, "zstd")


def _zstd_may_win(positions: np.ndarray, rice_bytes: int) -> bool:
    """Whether the gaps hold more structure than a Rice code takes in: more zero gaps, repeated
    gaps or repeated triples of gaps (in the first :data:`PATTERN_SAMPLE`) than twice what
    independent changes at this density give, or a Rice code over 10% above the entropy of
    geometric gaps of the same mean (a marginal a Rice code does not fit). Otherwise the zstd
    trial (~20 us a call whatever its size, most of what a small tensor's positions cost) is
    skipped. Missed: a pattern whose period is longer than the sample."""
    from .kernels import zstd_may_win

    return bool(zstd_may_win(positions, rice_bytes, PATTERN_SAMPLE))


def encode_positions_classed(positions: np.ndarray, base: np.ndarray, dtype: torch.dtype) -> bytes:
    """Per exponent class of the base element: the class-local indices of its changes, as Rice-
    coded gaps. Costs a pass over the whole base tensor, at both ends."""
    from .kernels import class_local_indices

    shift, mask = EXPONENT[dtype]
    cls = np.empty(positions.shape[0], dtype=np.int64)
    local = np.empty(positions.shape[0], dtype=np.int64)
    class_local_indices(base, shift, mask, positions, cls, local)
    order = np.argsort(cls, kind="stable")  # by class; within a class, local indices ascend
    cls, local = cls[order], local[order]
    parts = []
    for c in np.unique(cls):
        lo, hi = np.searchsorted(cls, c), np.searchsorted(cls, c, side="right")
        code = rice_encode(np.diff(local[lo:hi], prepend=-1).astype(np.uint64) - np.uint64(1))
        parts += [_CLASSED.pack(int(c), int(hi - lo), len(code)), code]
    return b"".join(parts)


def decode_positions_classed(blob, count: int, base: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    from .kernels import positions_from_classes

    blob = memoryview(blob).cast("B")
    starts, ends = np.zeros(256, dtype=np.int64), np.zeros(256, dtype=np.int64)
    locals_, at, total = [], 0, 0
    while at < len(blob):
        if at + _CLASSED.size > len(blob):
            raise DeltaError("corrupt", "classed positions: truncated class header")
        c, n, size = _CLASSED.unpack_from(blob, at)
        at += _CLASSED.size
        if n == 0 or ends[c] or at + size > len(blob) or total + n > count:
            raise DeltaError("corrupt", "classed positions: bad class entry")
        locals_.append(rice_decode(blob[at:at + size], n, running=True))
        starts[c], ends[c] = total, total + n
        at, total = at + size, total + n
    if total != count:
        raise DeltaError("corrupt", f"classed positions: {total} changes, header says {count}")
    shift, mask = EXPONENT[dtype]
    out = np.empty(count, dtype=np.int64)
    local = np.concatenate(locals_) if locals_ else np.empty(0, dtype=np.int64)
    if positions_from_classes(base, shift, mask, local, starts, ends, out) != count:
        raise DeltaError("corrupt", "classed positions do not fit the base tensor")
    return out


def decode_positions(blob, count: int, gap_bytes: int, numel: int, coder: str = "zstd") -> np.ndarray:
    from .kernels import gaps_to_positions

    if coder == "rice":  # checked in the decoding pass
        return rice_decode(blob, count, running=True, limit=numel)
    if not 1 <= gap_bytes <= 8:
        raise DeltaError("corrupt", f"gap width {gap_bytes} bytes")
    planes = np.frombuffer(zstd_decompress(blob, count * gap_bytes), dtype=np.uint8)
    positions = np.empty(count, dtype=np.int64)
    gaps_to_positions(planes, count, gap_bytes, positions)
    if count and (positions[-1] >= numel or positions[0] < 0 or
                  (count > 1 and np.any(positions[1:] <= positions[:-1]))):
        raise DeltaError("corrupt", f"positions run outside a tensor of {numel} elements")
    return positions


def encode_values(bits: np.ndarray) -> bytes:
    return zstd_compress(_to_planes(bits))


def decode_values(blob, count: int, dtype) -> np.ndarray:
    from .kernels import join_planes

    dtype = np.dtype(dtype)
    planes = np.frombuffer(zstd_decompress(blob, count * dtype.itemsize), dtype=np.uint8)
    out = np.empty(count * dtype.itemsize, dtype=np.uint8)
    join_planes(planes, dtype.itemsize, out)
    return out.view(dtype.newbyteorder("<")).astype(dtype, copy=False)


# Value kinds: what is stored at each changed position, and how it is compressed.
#   xor: old ^ new bits (entropy-coded: mostly a few low bits flip)
#   add: new - old as wrapping integers of the bit patterns, zigzagged (entropy-coded: a one-ulp
#        step is +-1 whatever the carry, so this is usually the smallest; exact, not float math)
#   set: the new bits (zstd'd byte planes; idempotent)
VALUE_CODERS = {"xor": "ans", "add": "ans", "set": "zstd"}


def value_bits(mode: str, xor: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The unsigned array a value kind stores, from the XOR and new bits at the same positions."""
    if mode == "xor":
        return xor
    if mode == "set":
        return new
    return new - (new ^ xor)  # wraps: unsigned arithmetic


def encode_value_bits(mode: str, bits: np.ndarray) -> bytes:
    if VALUE_CODERS[mode] == "zstd":
        return encode_values(bits)
    return encode_ints(bits, zigzag=mode == "add")


def decode_value_bits(mode: str, blob, count: int, dtype, coder: str, tables: TableCoding = "gamma") -> np.ndarray:
    if coder == "zstd":
        return decode_values(blob, count, dtype)
    return decode_ints_into(blob, np.empty(count, dtype=dtype), zigzag=mode == "add", tables=tables)


# --------------------------------------------------------------------------- encode


@dataclass
class EncodedTensor:
    entry: TensorEntry
    blobs: dict[str, torch.Tensor]  # safetensors name -> tensor


def _u8(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


SAMPLE = 4096  # changes from which the size of each value kind is estimated
SET_GATE = 1024  # of those, the ones that decide whether "set" is worth a zstd trial
PATTERN_SAMPLE = 512  # gaps searched for a repeating pattern (of a period up to about this)


def sparse_entry(base_entry: TensorEntry, name: str, positions: np.ndarray | None, mode: str,
                 bits: np.ndarray, changed: int) -> EncodedTensor:
    """Encode values of one kind at the given positions (None: every element)."""
    return _sparse(base_entry, name, mode, changed, encode_value_bits(mode, bits),
                   None if positions is None else encode_positions(positions))


def _sparse(base_entry: TensorEntry, name: str, mode: str, changed: int, values: bytes | torch.Tensor,
            positions: tuple[bytes | torch.Tensor, int, str] | None, fingerprint: str | None = None
            ) -> EncodedTensor:
    """A sparse tensor's entry and blobs from its coded values and (None: every element) its
    :func:`encode_positions`; a blob is given as bytes or as a uint8 tensor. ``fingerprint``:
    the target's, if the entry does not hold it yet."""
    blobs = {name + VAL: values if isinstance(values, torch.Tensor) else _u8(values)}
    coders, gap_bytes = {VAL: VALUE_CODERS[mode]}, 0
    if positions is not None:
        blob, gap_bytes, coders[POS] = positions
        blobs[name + POS] = blob if isinstance(blob, torch.Tensor) else _u8(blob)
    # a new entry from the base's fields (all of them, whatever they are) and these: ~3 us,
    # against ~5 for a model_copy (~2 us an attribute set)
    return EncodedTensor(TensorEntry(**{
        **base_entry.__dict__, "fingerprint": base_entry.fingerprint if fingerprint is None else fingerprint,
        "changed": changed, "encoding": mode, "positions": "all" if positions is None else "gaps",
        "gap_bytes": gap_bytes, "coders": coders}), blobs)


def choose_mode(xor: np.ndarray, new: Callable[[int], np.ndarray]) -> str:
    """The value kind estimated smallest on the first changes (``new(k)``: the new bits of the
    first k changes, gathered only for the sample).

    ``set`` is tried with zstd only where the order-0 entropy of its byte planes (on the first
    :data:`SET_GATE` changes) comes within 2x of the better entropy-coded kind: weights that move
    by a few ulps make it 5-10x larger, and the trial was most of this choice's cost (45 of 55 us
    on a full sample)."""
    from .kernels import value_kind_sizes

    k = min(SAMPLE, xor.shape[0])
    sx, sn = xor[:k], new(k)
    gate = min(SET_GATE, k)
    out = np.empty(3)
    value_kind_sizes(np.ascontiguousarray(sx), np.ascontiguousarray(sn), gate, ALPHABET, out)
    xor_bytes, add_bytes, set_entropy = out.tolist()
    sizes = {"xor": xor_bytes, "add": add_bytes}
    if k == 0 or set_entropy * k / gate < 2 * min(sizes.values()):
        sizes["set"] = len(encode_values(sn))
    return min(sizes, key=sizes.get)


@dataclass
class DenseChange:
    """A change of more than :data:`POSITIONS_UP_TO` of a tensor's elements: the XOR of every
    element, so the new bits alone can be encoded later, element by element."""

    xor: np.ndarray
    count: int


# A change found by a pass over every element (the scan stopped at a chunk's cap) keeps its
# positions up to this share of the elements. Coding every element instead (positions "all")
# was 1-2% smaller from 6% to 60% changed, but its decode reads a symbol per element, not per
# change: 4.0 against 0.6 ms at 6% of 1M bf16 elements, 5.0 against 2.0 at 25%, 4.1 against 3.8
# at 60%; at 6% of 26M parameters (real gradients) a dozen such tensors were 8 of 19 ms of apply.
POSITIONS_UP_TO = 1 / 2


def full_pass_change(old: torch.Tensor, new: torch.Tensor, *, update: bool = False,
                     out: np.ndarray | None = None) -> Changes | DenseChange:
    """The change of two contiguous tensors of one bit-view dtype from one pass over every
    element, which also refreshes ``old`` (``update``): its :class:`Changes` (new bits left to
    gather) up to :data:`POSITIONS_UP_TO` of the elements, else its :class:`DenseChange`.
    ``out``: a buffer of the XOR's size to reuse."""
    from .kernels import xor_refresh

    o, n = unsigned_view(old), unsigned_view(new)
    if out is None:
        out = np.empty_like(o)
    count = int(xor_refresh(o, n, out, update))
    if count > POSITIONS_UP_TO * o.shape[0]:
        return DenseChange(out, count)
    positions = np.flatnonzero(out)
    return Changes(positions, out[positions])


def encode_tensor(name: str, old: torch.Tensor, new: torch.Tensor, *, update: bool = False,
                  digest: str | None = None, fingerprint: str | None = None,
                  base_fingerprint: Fingerprint | None = None, threads: bool = True,
                  compact: bool = False) -> EncodedTensor:
    """Encode how ``new`` differs from ``old`` (refreshing ``old`` in place if ``update``).

    ``compact`` also tries positions coded per exponent class of the base element (smaller when
    changes concentrate on small weights, as at RL learning rates), which costs a pass over the
    whole tensor to encode and needs the base to decode. ``fingerprint``/``base_fingerprint``:
    see :func:`encode_found`.
    """
    found = detect_tensor(name, old, new, update=update, digest=digest, threads=threads)
    return encode_found(name, new.contiguous(), found, digest=digest, fingerprint=fingerprint,
                        base_fingerprint=base_fingerprint, compact=compact)


def tensor_entry(t: torch.Tensor, digest: str | None, fingerprint: str = "") -> TensorEntry:
    """The entry of ``t`` as it is now, before its coding: its dtype and shape, ``digest`` when the
    caller knows it or passed ``""`` (not wanted), else computed, and ``fingerprint`` if known."""
    return TensorEntry(dtype=dtype_name(t.dtype), shape=list(t.shape),
                       digest=tensor_digest(t) if digest is None else digest, fingerprint=fingerprint)


def detect_tensor(name: str, old: torch.Tensor, new: torch.Tensor, *, update: bool = False,
                  digest: str | None = None, same_digest: str | None = None,
                  threads: bool = True) -> EncodedTensor | Changes | DenseChange:
    """The part of :func:`encode_tensor` that reads ``new``: a bit-view tensor that changed comes
    back as its :class:`Changes` or :class:`DenseChange`, for :func:`encode_found` to finish from
    any copy of the new bits (with ``update``, the refreshed ``old``), so a caller may let
    ``new`` change again meanwhile; every other case comes back encoded. ``same_digest``: the
    digest of ``old``, used if nothing changed (then it is also ``new``'s)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise DeltaError("shape_mismatch", f"{name}: {tuple(old.shape)}/{old.dtype} -> "
                         f"{tuple(new.shape)}/{new.dtype}")
    new = new.contiguous()

    def entry() -> TensorEntry:
        return tensor_entry(new, digest)

    if new.dtype not in INT_VIEW:
        if raw_bytes(old) == raw_bytes(new):
            return EncodedTensor(entry(), {})
        size = new.element_size()
        changed = int((old.reshape(-1).view(torch.uint8).view(-1, size)
                       != new.reshape(-1).view(torch.uint8).view(-1, size)).any(1).sum())
        if update:
            old.copy_(new)
        return EncodedTensor(entry().model_copy(update={"encoding": "full", "changed": changed}), {name: new.clone()})
    changes = find_changes(old, new, update=update, threads=threads)
    if changes is None:  # the scan stopped at a cap: one pass over every element
        return full_pass_change(old, new, update=update)
    if changes.count == 0:
        if same_digest is not None and digest is None:
            digest = same_digest
        return EncodedTensor(entry(), {})
    return changes


def encode_found(name: str, new: torch.Tensor, found: EncodedTensor | Changes | DenseChange, *,
                 digest: str | None = None, fingerprint: str | None = None,
                 base_fingerprint: Fingerprint | None = None, compact: bool = False) -> EncodedTensor:
    """What :func:`detect_tensor` found, encoded from the new bits ``new`` alone (the old ones
    are ``new ^ xor``). The entry's fingerprint is ``fingerprint`` when the caller knows it,
    else ``base_fingerprint`` (the old tensor's) updated at the changed positions, else the
    whole new tensor's."""
    new_at = gather_new(new, found)
    enc = _encode_found(name, new, found, new_at, digest=digest, compact=compact)
    if not enc.entry.fingerprint:
        enc.entry.fingerprint = fingerprint or fingerprint_after(new, found, base_fingerprint, new_at).hex()
    return enc


def gather_new(new: torch.Tensor, found: EncodedTensor | Changes | DenseChange) -> np.ndarray | None:
    """The new bits at the changed positions (for :class:`Changes`): the scan's, or gathered once
    (a cache miss per change) for the values and the fingerprint both."""
    if not isinstance(found, Changes):
        return None
    return found.new if found.new is not None else unsigned_view(new)[found.positions]


def fingerprint_after(new: torch.Tensor, found: EncodedTensor | Changes | DenseChange,
                      base: Fingerprint | None, new_at: np.ndarray | None) -> Fingerprint:
    """The new tensor's fingerprint: from the base's in O(changes) where the change is sparse
    and the base's is known, else from every element. ``new_at``: the new bits at the changed
    positions (for :class:`Changes`)."""
    if base is not None:
        if isinstance(found, EncodedTensor) and found.entry.encoding == "same":
            return base
        if isinstance(found, Changes):
            return base + fingerprint_delta(found.positions, new_at ^ found.xor, new_at, new.element_size() * 8)
    return tensor_fingerprint(new, threads=False)


def fingerprints_after(batch: ChangeBatch, base: Mapping[str, str]) -> dict[str, str]:
    """The new fingerprints of the tensors of ``batch`` from their bases' ``base[name]``, all as
    hex (as entries carry them), in one kernel call: a call per tensor cost ~30 us, most of what
    a tensor with few changes costs."""
    lanes = delta_lanes(batch.positions, batch.new ^ batch.xor, batch.new, batch.starts, batch.new.itemsize * 8)
    return dict(zip(batch.names, add_lanes([base[n] for n in batch.names], lanes)))


def _encode_found(name: str, new: torch.Tensor, found: EncodedTensor | Changes | DenseChange,
                  new_at: np.ndarray | None, *, digest: str | None, compact: bool) -> EncodedTensor:
    if isinstance(found, EncodedTensor):
        return found
    entry = tensor_entry(new, digest)
    if isinstance(found, DenseChange):
        n = unsigned_view(new)
        mode = choose_mode(found.xor, lambda k=None: n[:k])
        return sparse_entry(entry, name, None, mode, value_bits(mode, found.xor, n), found.count)
    pos, xor = found.positions, found.xor

    def classed() -> bytes:
        base = unsigned_view(new).copy()  # the base bits: old ones where changed
        base[pos] ^= xor
        return encode_positions_classed(pos, base, new.dtype)

    return encode_changes(entry, name, pos, xor, lambda k=None: new_at[:k], classed if compact else None)


def encode_changes(entry: TensorEntry, name: str, pos: np.ndarray, xor: np.ndarray,
                   new_at: Callable[..., np.ndarray], classed: Callable[[], bytes] | None = None) -> EncodedTensor:
    """The sparse case of a tensor from its changes, wherever they were found: the value kind
    estimated smallest, its blob, the positions' blob and (``classed``: positions coded per
    exponent class, computed only if asked) the smaller positions coding. ``new_at(k)``: the
    new bits at the first k changes (all with no argument), gathered only for the kind that
    needs them."""
    mode = choose_mode(xor, new_at)
    bits = xor if mode == "xor" else value_bits(mode, xor, new_at())
    enc = sparse_entry(entry, name, pos, mode, bits, pos.shape[0])
    if classed is not None:
        blob = classed()
        if len(blob) < enc.blobs[name + POS].numel():
            enc.blobs[name + POS] = _u8(blob)
            enc.entry.positions, enc.entry.gap_bytes = "classed", 0
            enc.entry.coders = {**enc.entry.coders, POS: "rice"}
    return enc


class ChangeBatch(NamedTuple):
    """The sparse changes of several tensors of one element width, end to end: tensor ``k``
    (``names[k]``) changed at ``positions[starts[k]:starts[k + 1]]`` (sorted), by the XORs there,
    to the new bits there. The kernels after detection (the new fingerprints, the coding) take a
    batch in one call each: a call per tensor cost more than a tensor of 0.1% changed, and the
    arrays are joined once, not once per kernel."""

    names: list[str]
    starts: np.ndarray  # int64, one more than names
    positions: np.ndarray  # int64
    xor: np.ndarray  # unsigned, of the element width
    new: np.ndarray  # the same type

    @classmethod
    def join(cls, names: Sequence[str], positions: Sequence[np.ndarray], xor: Sequence[np.ndarray],
             new: Sequence[np.ndarray] | None) -> ChangeBatch:
        """The batch of these tensors' arrays; ``new`` None: left to fill (uninitialised)."""
        starts = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum([p.shape[0] for p in positions], out=starts[1:])
        joined = np.concatenate(xor)
        return cls(list(names), starts, np.concatenate(positions), joined,
                   np.empty_like(joined) if new is None else np.concatenate(new))

    def part(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tensor ``k``'s positions, XORs and new bits (views)."""
        a, b = self.starts[k], self.starts[k + 1]
        return self.positions[a:b], self.xor[a:b], self.new[a:b]


def change_batches(found: Mapping[str, Changes], after: Mapping[str, torch.Tensor]) -> list[ChangeBatch]:
    """``found``'s changes joined per element width, each with the new bits: the scan's where it
    recorded them all, else gathered from ``after`` (the tensors after the change: contiguous,
    on the CPU) in one kernel call; a gather per tensor cost ~10 us of numpy and torch views
    beside its cache misses."""
    from .kernels import gather_many

    widths: dict[np.dtype, list[str]] = {}
    for n, c in found.items():
        widths.setdefault(c.xor.dtype, []).append(n)
    out = []
    for dtype, names in widths.items():
        changes = [found[n] for n in names]
        scanned = all(c.new is not None for c in changes)
        batch = ChangeBatch.join(names, [c.positions for c in changes], [c.xor for c in changes],
                                 [c.new for c in changes] if scanned else None)
        if not scanned:
            tensors = [after[n] for n in names]
            if not all(t.is_cpu and t.is_contiguous() and t.element_size() == dtype.itemsize for t in tensors):
                raise ValueError("the tensors after the change must be contiguous, on the CPU, of "
                                 f"{dtype.itemsize * 8}-bit elements")
            table = np.array([(t.data_ptr(), t.numel()) for t in tensors], dtype=np.int64)
            bad = gather_many(table, batch.new, batch.starts, batch.positions, batch.new)
            if bad >= 0:
                raise ValueError(f"{names[bad]}: changed positions outside its {tensors[bad].numel()} elements")
        out.append(batch)
    return out


def encode_changes_many(batch: ChangeBatch, entries: Sequence[TensorEntry],
                        fingerprints: Sequence[str] | None = None) -> list[EncodedTensor]:
    """:func:`encode_changes` of each tensor of ``batch`` (``entries``: their entries so far), the
    same bytes, in one kernel call (:func:`shared.kernels.encode_sparse_many`). A delta of 0.1%
    of a model is a hundred or more tensors of a few hundred changes, and coding them one by one
    cost ~100 us a tensor in calls, more than their changes did. The zstd trials of
    :func:`choose_mode` and :func:`encode_positions` run here, for the tensors the kernel flags.
    ``fingerprints``: the tensors' new ones, set in the one copy made of each entry (so the
    entries may be templates a caller keeps)."""
    from .kernels import NEEDS_ALL, NEEDS_POSITIONS_TRIAL, NEEDS_SET_TRIAL, SPAN_VAL, encode_sparse_many

    count = len(batch.names)
    spans = np.empty((count, 5), dtype=np.int64)
    estimates = np.empty((count, 2))
    buf = encode_sparse_many(batch.starts, batch.positions, batch.xor, batch.new, SAMPLE, SET_GATE,
                             PATTERN_SAMPLE, ALPHABET, spans, estimates)
    # The blobs tile ``buf``, a values' and a positions' blob per tensor (empty where the kernel
    # left them to the trials below): the kernel-only tensors (most of them) are handed on as
    # views of it, not as bytes objects copied and wrapped one by one.
    blobs = torch.from_numpy(buf).split(np.diff(spans[:, SPAN_VAL:], axis=1).ravel().tolist())
    changed = np.diff(batch.starts).tolist()
    out: list[EncodedTensor] = []
    for k, (name, entry, (needs, add, _, at, end), estimate) in enumerate(
            zip(batch.names, entries, spans.tolist(), estimates.tolist())):
        mode = "add" if add else "xor"
        values, rice = blobs[2 * k], blobs[2 * k + 1]
        fingerprint = None if fingerprints is None else fingerprints[k]
        if not needs:
            out.append(_sparse(entry, name, mode, changed[k], values, (rice, 0, "rice"), fingerprint))
            continue
        pos, xor, new = batch.part(k)
        if needs & NEEDS_ALL:  # encode_changes makes the entry itself: the fingerprint first
            if fingerprint is not None:
                entry = entry.model_copy(update={"fingerprint": fingerprint})
            out.append(encode_changes(entry, name, pos, xor, lambda n=None, new=new: new[:n]))
            continue
        if needs & NEEDS_SET_TRIAL:  # the kernel coded no values
            if len(trial := encode_values(new[:SAMPLE])) < min(estimate):
                mode, values = "set", trial if new.shape[0] <= SAMPLE else encode_values(new)
            else:
                values = encode_value_bits(mode, value_bits(mode, xor, new))
        positions = _zstd_trial(pos, bytes(buf[at:end])) if needs & NEEDS_POSITIONS_TRIAL else (rice, 0, "rice")
        out.append(_sparse(entry, name, mode, pos.shape[0], values, positions, fingerprint))
    return out


def encode_state(base: Mapping[str, torch.Tensor],
                 new: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor], *,
                 update: bool = False, digests: Mapping[str, str] | None = None,
                 base_fingerprints: Mapping[str, Fingerprint] | None = None,
                 progress: bool = False, compact: bool = False) -> dict[str, EncodedTensor]:
    """Encode every tensor of ``base``, several at a time (the kernels and compressors release
    the GIL). ``new`` may be a function of the name, so that e.g. a bf16 cast of fp32 master
    weights exists for one tensor at a time rather than for the whole model. ``digests``: of
    the new tensors, if known; ``base_fingerprints``: of ``base``, if known (a caller that keeps
    them, as a publisher does, gets the new ones in O(changes) instead of from every element).
    The sparse changes are coded together at the end (:func:`encode_changes_many`)."""
    names = sorted(base)
    get = new if callable(new) else new.__getitem__

    def one(n: str) -> EncodedTensor | tuple[TensorEntry, Changes]:
        """``n`` encoded, or its entry and sparse change (with the new bits there), with
        everything that needs the new tensor done."""
        t, digest = get(n), digests[n] if digests else None
        base_fingerprint = base_fingerprints[n] if base_fingerprints else None
        found = detect_tensor(n, base[n], t, update=update, digest=digest, threads=False)
        t = t.contiguous()
        if compact or not isinstance(found, Changes):
            return encode_found(n, t, found, digest=digest, base_fingerprint=base_fingerprint, compact=compact)
        # from the base's, for all of them at once below; else from every element, while t exists
        fingerprint = "" if base_fingerprint is not None else tensor_fingerprint(t, threads=False).hex()
        return tensor_entry(t, digest, fingerprint), Changes(found.positions, found.xor, gather_new(t, found))

    from tqdm.auto import tqdm

    sizes = [base[n].numel() * base[n].element_size() for n in names]
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="encode", disable=not progress) as bar:
        found = dict(zip(names, map_balanced(one, names, sizes, bar)))
    sparse = [n for n in names if isinstance(found[n], tuple)]

    def code(members: list[str]) -> list[EncodedTensor]:
        coded = {}
        # every change carries its new bits, so change_batches needs no tensor to gather them from
        for batch in change_batches({n: found[n][1] for n in members}, {}):
            entries = [found[n][0] for n in batch.names]
            if base_fingerprints is not None:  # the new fingerprints from the bases'
                fingerprints = fingerprints_after(batch, {n: base_fingerprints[n].hex() for n in batch.names})
                for n, e in zip(batch.names, entries):
                    e.fingerprint = fingerprints[n]
            coded.update(zip(batch.names, encode_changes_many(batch, entries)))
        return [coded[n] for n in members]

    found.update(zip(sparse, map_batches(code, sparse, [found[n][1].count for n in sparse],
                                         serial_below=THREADS_FROM_CHANGES)))
    return found


def _metadata(header: Header) -> dict[str, str]:
    # The format version always written out first (before format 3 it was left out as a
    # default). pydantic's own JSON, not json.dumps of a dict: 0.09 against 0.34 ms for a
    # header of 79 tensors, which a publisher writes every version. It starts '{"kind":'.
    body = header.model_dump_json(exclude_defaults=True)
    text = f'{{"format_version":{header.format_version},{body[1:]}'
    return {"format": FORMAT, "deltasync": text, "deltasync_blake3": blake3.blake3(text.encode()).hexdigest()}


def build_delta(encoded: Mapping[str, EncodedTensor], *, version: int, base_version: int,
                base_commitment: str, base_state_digest: str = "",
                via: list[str] = ()) -> tuple[Header, dict[str, torch.Tensor]]:
    entries = {n: e.entry for n, e in encoded.items()}
    sf = entries_fingerprint(entries)
    header = Header(kind="delta", version=version, base_version=base_version,
                    base_commitment=base_commitment, base_state_digest=base_state_digest, via=list(via),
                    commitment=chain_commitment(base_commitment, [*via, sf]),
                    state_digest=entries_digest(entries), state_fingerprint=sf,
                    tensors=dict(sorted(entries.items())))
    tensors = {k: v for e in encoded.values() for k, v in e.blobs.items()}
    header.payload_blake3 = payload_digest(tensors)
    return header, tensors


PAYLOAD_PIECE = 1 << 20  # bytes of the digest's input joined per blake3 update (an update a blob cost more)


def payload_digest(blobs: Mapping[str, torch.Tensor]) -> str:
    """blake3 over the blobs (``name::...``) in name order: name, NUL, bytes, for each. The
    writer's blobs are contiguous uint8 tensors, read where they lie: a delta of 0.1% of a model
    is a hundred or more blobs of a few hundred bytes, and a tensor's ``numpy()`` each, to join
    them, cost more than hashing them (0.25 against 0.15 ms for 116 blobs)."""
    from .kernels import join_named

    names = sorted(k for k in blobs if "::" in k)
    encoded = [n.encode() for n in names]
    sizes = [len(e) for e in encoded]
    table = np.empty((len(names), 4), dtype=np.int64)  # address, length, name's start and end
    table[:, 0], table[:, 1] = [blobs[n].data_ptr() for n in names], [blobs[n].numel() for n in names]
    np.cumsum(sizes, out=table[:, 3])
    table[:, 2] = table[:, 3] - sizes
    joined = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    ends = np.cumsum(table[:, 3] - table[:, 2] + 1 + table[:, 1])  # of each blob's input
    h = blake3.blake3()
    out = np.empty(0, dtype=np.uint8)
    k = 0
    while k < len(names):  # the blobs from k whose input fits a piece (at least one)
        before = int(ends[k - 1]) if k else 0
        j = max(k + 1, int(np.searchsorted(ends, before + PAYLOAD_PIECE, side="right")))
        size = int(ends[j - 1]) - before
        if out.shape[0] < size:
            out = np.empty(max(size, min(PAYLOAD_PIECE, int(ends[-1]))), dtype=np.uint8)
        join_named(table[k:j], joined, out)
        h.update(out[:size])
        k = j
    return h.hexdigest()


def _views_digest(blobs: Mapping[str, np.ndarray]) -> str:
    """:func:`payload_digest` of a reader's blobs, views of the file: joined in Python, which
    for views costs less than the writer's kernel call and its table (a verify of 116 blobs
    0.19 against 0.26 ms)."""
    h = blake3.blake3()
    pending: list = []
    size = 0
    for name in sorted(k for k in blobs if "::" in k):
        pending += [name.encode() + b"\0", blobs[name]]
        size += pending[-1].nbytes
        if size >= PAYLOAD_PIECE:
            h.update(b"".join(pending))
            pending, size = [], 0
    h.update(b"".join(pending))
    return h.hexdigest()


def save_delta(header: Header, tensors: Mapping[str, torch.Tensor]) -> bytes:
    if all(t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous() for t in tensors.values()):
        # the file the library's writers make, given as safetensors' own TensorSpecs: their
        # per-array checks cost ~7-13 us a blob (0.96 against 0.20 ms for 131 blobs). ``tensors``
        # keeps every blob alive while serialize reads it.
        return safetensors.serialize({k: safetensors.TensorSpec(dtype="uint8", shape=[t.numel()], data_ptr=t.data_ptr(),
                                                                 data_len=t.numel()) for k, t in tensors.items()},
                                     metadata=_metadata(header))
    return safetensors.torch.save(dict(tensors), metadata=_metadata(header))


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                 version: int, base_version: int, base_commitment: str,
                 base_state_digest: str = "", update_base: bool = False, progress: bool = False,
                 compact: bool = False) -> bytes:
    """Delta file bytes taking ``base`` to ``new`` (same names, shapes and dtypes)."""
    if set(base) != set(new):
        raise DeltaError("shape_mismatch", f"tensor names differ: {sorted(set(base) ^ set(new))[:5]}")
    base_state_digest = base_state_digest or state_digest(base)
    encoded = encode_state(base, new, update=update_base, progress=progress, compact=compact)
    header, tensors = build_delta(encoded, version=version, base_version=base_version,
                                  base_commitment=base_commitment, base_state_digest=base_state_digest)
    return save_delta(header, tensors)


def anchor_header(state: Mapping[str, torch.Tensor], *, version: int,
                  base_version: int | None = None, base_commitment: str = "",
                  via: list[str] = (), digests: Mapping[str, str] | None = None,
                  fingerprints: Mapping[str, str] | None = None) -> Header:
    """Header of a full state. The genesis anchor has base commitment ""; a later anchor
    restates version v of an existing chain and so carries that chain's commitment.
    ``digests``/``fingerprints`` (hex): the tensors' own, when the caller holds them already."""
    digests = digests or {n: tensor_digest(t) for n, t in state.items()}
    fps = fingerprints or {n: fp.hex() for n, fp in fingerprints_of(state).items()}
    entries = {n: TensorEntry(dtype=dtype_name(t.dtype), shape=list(t.shape), digest=digests[n],
                              fingerprint=fps[n], changed=t.numel(), encoding="full")
               for n, t in sorted(state.items())}
    sf = entries_fingerprint(entries)
    return Header(kind="anchor", version=version, base_version=base_version,
                  base_commitment=base_commitment, via=list(via),
                  commitment=chain_commitment(base_commitment, [*via, sf]),
                  state_digest=entries_digest(entries), state_fingerprint=sf, tensors=entries)


def save_anchor(state: Mapping[str, torch.Tensor], path: str | Path, header: Header) -> None:
    tensors = {n: t.detach().contiguous() for n, t in state.items()}
    safetensors.torch.save_file(tensors, str(path), metadata=_metadata(header))


# --------------------------------------------------------------------------- read


def _parse_header(raw: bytes, where: str = "") -> Header:
    return _header_from_doc(_header_doc(raw, where), where)


def _header_doc(raw: bytes, where: str = "") -> dict:
    """The safetensors header (JSON) as parsed, not yet checked."""
    try:
        return json.loads(raw)
    except ValueError:
        raise DeltaError("format", f"{where}not a safetensors file (its header is not JSON)") from None


def _header_from_doc(doc, where: str = "") -> Header:
    try:
        meta = (doc.get("__metadata__") if isinstance(doc, dict) else None) or {}
        if meta.get("format") != FORMAT or "deltasync" not in meta:
            raise DeltaError("format", f"{where}not a deltasync file (a safetensors file without "
                                       "deltasync metadata)")
        if blake3.blake3(meta["deltasync"].encode()).hexdigest() != meta.get("deltasync_blake3"):
            raise DeltaError("corrupt", f"{where}header checksum mismatch")
        retired = not meta["deltasync"].startswith('{"format_version":')  # formats 1 and 2 left it out
        if not retired:
            header = Header.model_validate_json(meta["deltasync"])
    except (ValueError, ValidationError, AttributeError) as e:
        raise DeltaError("format", f"{where}unreadable header: {str(e).splitlines()[0]}") from None
    if retired:
        raise DeltaError("format", f"{where}format version 1 or 2 (commitments over blake3 state digests) is no "
                                   "longer read; publish the chain again with this deltasync (its anchors load as "
                                   "checkpoints)")
    if header.format_version not in ANS_TABLES:
        raise DeltaError("format", f"{where}format version {header.format_version} is not supported "
                                   f"(this deltasync reads {', '.join(map(str, ANS_TABLES))})")
    entries = header.tensors.values()
    if not _all_hex64([e.digest for e in entries if e.digest]) or \
            entries_digest(header.tensors) != header.state_digest or \
            (header.kind == "anchor" and not header.state_digest):
        raise DeltaError("corrupt", "header's tensor digests do not add up to its state digest")
    if entries_fingerprint(header.tensors) != header.state_fingerprint or \
            not _all_hex64([e.fingerprint for e in entries]):
        raise DeltaError("corrupt", "header's tensor fingerprints do not add up to its state fingerprint")
    if header.commitment != chain_commitment(header.base_commitment, [*header.via, header.state_fingerprint]):
        raise DeltaError("corrupt", "header's commitment does not follow from its base and state fingerprints")
    return header


def holds(entry: TensorEntry, t: torch.Tensor) -> bool:
    """Whether ``t`` is the entry's target: by its blake3 digest where the entry has one, else by
    its fingerprint."""
    if entry.digest:
        return tensor_digest(t) == entry.digest
    return tensor_fingerprint(t).hex() == entry.fingerprint


def _all_hex64(texts: list[str]) -> bool:
    """Whether each text is 64 lowercase hex digits: one match over them all (a match each cost
    ~50 us a header of 90 tensors)."""
    return all(len(t) == 64 for t in texts) and _HEX.fullmatch("".join(texts)) is not None


def header_length(head: bytes, size: int, where: str = "") -> int:
    """The JSON header's length from a safetensors file's first 8 bytes, checked against the
    file's size (never trusted: a non-safetensors file makes it anything up to 2**64)."""
    if len(head) < 8 or size < 8:
        raise DeltaError("format", f"{where}not a safetensors file ({size} bytes, too short)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > size - 8:
        raise DeltaError("format", f"{where}not a safetensors file, or truncated (header of {n:,} bytes "
                                   f"in a file of {size:,})")
    return n


def read_header_bytes(data: bytes, where: str = "") -> Header:
    """Header from the safetensors preamble (8-byte length + JSON), without loading tensors."""
    n = header_length(data[:8], len(data), where)
    return _parse_header(data[8 : 8 + n], where)


def _object_spans(doc: dict, start: int, size: int) -> dict[str, tuple[str, list[int], int, int]]:
    """The objects of a parsed safetensors header: name -> (dtype, shape, first byte, end) in a
    file of ``size`` bytes whose data section starts at ``start``, checked as safetensors checks
    them (a known dtype, as many bytes as the shape needs, the data section covered exactly
    without holes or overlaps), so that blobs can be read as views of the file's bytes.
    (``safetensors.deserialize`` copies every object, ~0.9 ms for a delta of 0.1% of 25M.)"""
    out, spans = {}, []
    for name, spec in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
            ok = dtype in TORCH_DTYPES and isinstance(shape, list) and \
                all(type(d) is int and d >= 0 for d in shape) and type(begin) is int and type(end) is int and \
                0 <= begin <= end and end - begin == math.prod(shape) * TORCH_DTYPES[dtype].itemsize
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise DeltaError("corrupt", f"safetensors: object {name!r} is described wrongly")
        out[name] = (dtype, shape, start + begin, start + end)
        spans.append((begin, end))
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            raise DeltaError("corrupt", "safetensors: objects overlap or leave a hole")
        at = end
    if start + at != size:
        raise DeltaError("corrupt", f"safetensors: the objects take {at:,} bytes, the file holds "
                                    f"{size - start:,} after its header (truncated?)")
    return out


def read_header(path: str | Path) -> Header:
    where = f"{path}: "
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), size, where)
        raw = f.read(n)
        if len(raw) != n:
            raise DeltaError("format", f"{where}truncated header")
    return _parse_header(raw, where)


@dataclass
class TensorChange:
    """One tensor's decoded change, in checkpoint coordinates.

    ``positions`` is None when every element is given. ``bits`` is the integer view of the
    element dtype (int16 for bf16/fp16, int32 for fp32); for ``"full"`` it is the new tensor
    itself in its own dtype.
    """

    name: str
    mode: Literal["xor", "add", "set", "full"]
    positions: torch.Tensor | None
    bits: torch.Tensor

    def new_bits(self, old_bits: torch.Tensor) -> torch.Tensor:
        """New element bits given the old ones at the same positions."""
        return combine(self.mode, old_bits, self.bits)


class DecodedBatch(NamedTuple):
    """Sparse changes of tensors of one element width, decoded together and kept joined: tensor
    ``k`` (``names[k]``) changed at ``positions[bounds[k]:bounds[k + 1]]`` (sorted) by ``bits``
    there, under ``modes[k]``. A replica stages a batch from the joined arrays in one call
    (:func:`shared.fingerprint.gather_batch`), without a view per tensor to make and check."""

    names: list[str]
    modes: list[str]
    bounds: np.ndarray  # int64, one more than names
    positions: torch.Tensor  # int64
    bits: torch.Tensor  # the integer view of the element dtype

    def changes(self) -> list[TensorChange]:
        """One :class:`TensorChange` per tensor (views: one split each, not a slice per tensor)."""
        sizes = np.diff(self.bounds).tolist()
        return list(map(TensorChange, self.names, self.modes, self.positions.split(sizes), self.bits.split(sizes)))


def combine(mode: str, old_bits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """New bits from old bits and a change's stored bits (any device; integer views)."""
    if mode == "xor":
        return old_bits ^ bits
    if mode == "add":  # wrapping integer addition of the bit patterns
        wide = torch.int32 if old_bits.dtype == torch.int16 else torch.int64
        return (old_bits.to(wide) + bits.to(wide)).to(old_bits.dtype)
    return bits


def _sparse_failure(code: int, numel: int) -> str:
    """What ``kernels.decode_sparse``'s failure code means, in the words of the one-blob decoders."""
    from . import kernels as k

    return {k.RICE_K: "Rice parameter out of range", k.RICE_SHORT: "Rice-coded blob ends early",
            k.RICE_OUTSIDE: f"positions run outside a tensor of {numel} elements",
            k.ANS_SHORT: "entropy-coded blob: the code or its raw bits run out",
            k.ANS_WIDE: "entropy-coded blob: value wider than its element",
            k.ANS_TABLE: "entropy-coded blob: symbol table does not add up"}[code]


IN_MEMORY_MAX = 1 << 28  # files up to this size are read whole; larger ones (anchors) by tensor


class DeltaFile:
    """A parsed anchor or delta. Tensors load lazily; every blob is checked before use."""

    def __init__(self, header: Header, data: bytes | None = None,
                 objects: Mapping[str, tuple[str, list[int], int, int]] | None = None, handle=None, size: int = 0):
        """A file read into memory (``data``, its bytes, and ``objects``: name -> safetensors dtype,
        shape, first byte and end in ``data``, as :func:`_object_spans` checked them), or ``handle``
        (an open ``safetensors.safe_open`` for a file too large to read whole; each
        ``get_tensor`` costs ~40 us, and each opening re-parses the whole header)."""
        self.header = header
        self._data = None if data is None else np.frombuffer(data, dtype=np.uint8)
        self._objects = objects
        self._handle = handle
        self.size = size
        self._blobs: dict[str, np.ndarray] | None = None  # once verified

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "") -> DeltaFile:
        """The file in ``data``, which must not change while it is used: its blobs are views of
        it, checked once (:meth:`verify`)."""
        n = header_length(data[:8], len(data), where)
        doc = _header_doc(data[8:8 + n], where)
        header = _header_from_doc(doc, where)
        return cls(header, data, _object_spans(doc, 8 + n, len(data)), size=len(data))

    @classmethod
    def open(cls, path: str | Path) -> DeltaFile:
        size = Path(path).stat().st_size
        if size <= IN_MEMORY_MAX:
            return cls.from_bytes(Path(path).read_bytes(), where=f"{path}: ")
        header = read_header(path)
        try:
            handle = safetensors.safe_open(str(path), framework="pt")
        except Exception as e:
            raise DeltaError("corrupt", f"safetensors: {e}") from None
        return cls(header, handle=handle, size=size)

    def tensor(self, key: str) -> torch.Tensor:
        """A tensor of the file, in memory of its own (the caller may write into it)."""
        try:
            if self._objects is None:
                return self._handle.get_tensor(key)
            dtype, shape, begin, end = self._objects[key]
            if begin == end:
                return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
            return torch.frombuffer(bytearray(self._data[begin:end]), dtype=TORCH_DTYPES[dtype]).reshape(shape)
        except Exception as e:
            raise DeltaError("corrupt", f"object {key!r} unreadable: {e}") from None

    def verify(self) -> None:
        """Check every blob against the header's payload digest (once; the checked blobs are
        kept, so what is decoded is what was checked)."""
        if self._blobs is None:
            blobs = {k: self._blob_bytes(k) for k in self._keys() if "::" in k}
            if _views_digest(blobs) != self.header.payload_blake3:
                raise DeltaError("corrupt", "blob bytes do not match the header's payload digest")
            self._blobs = blobs

    def _blob_bytes(self, key: str) -> np.ndarray:
        """A blob's bytes (blobs are flat U8 objects): a view of the file where it is in memory."""
        if self._objects is None:
            return self.tensor(key).numpy()
        dtype, shape, begin, end = self._objects[key]
        if dtype != "U8" or len(shape) != 1:
            raise DeltaError("corrupt", f"object {key!r} is {dtype}{shape}, not a byte blob")
        return self._data[begin:end]

    def _spans(self, keys: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One buffer and where each blob of ``keys`` starts and ends in it: the file itself where
        it is in memory, else the blobs joined."""
        self.verify()
        missing = [k for k in keys if k not in self._blobs]
        if missing:
            raise DeltaError("corrupt", f"object {missing[0]!r} is missing")
        if self._objects is not None:
            spans = np.array([self._objects[k][2:] for k in keys], dtype=np.int64).reshape(-1, 2)
            return self._data, spans[:, 0].copy(), spans[:, 1].copy()
        blobs = [self._blobs[k] for k in keys]
        at = np.zeros(len(blobs) + 1, dtype=np.int64)
        np.cumsum([b.shape[0] for b in blobs], out=at[1:])
        return np.concatenate(blobs) if blobs else np.empty(0, np.uint8), at[:-1], at[1:]

    def _blob(self, name: str, suffix: str) -> np.ndarray:
        self.verify()
        blob = self._blobs.get(name + suffix)
        if blob is None:
            raise DeltaError("corrupt", f"object {name + suffix!r} is missing")
        return blob

    @property
    def _tables(self) -> TableCoding:
        """How this file's "ans" blobs code their frequency tables (by its format version)."""
        return ANS_TABLES[self.header.format_version]

    def _keys(self) -> list[str]:
        return list(self._objects if self._objects is not None else self._handle.keys())

    def change(self, name: str, base: torch.Tensor | None = None) -> TensorChange | None:
        """One tensor's change. ``base`` (the tensor it applies to, in checkpoint coordinates)
        is needed only for positions coded per exponent class."""
        e = self.header.tensors[name]
        if e.encoding == "same":
            return None
        if e.encoding == "full":
            t = self.tensor(name)
            if t.dtype != TORCH_DTYPES[e.dtype] or list(t.shape) != e.shape or not holds(e, t):
                raise DeltaError("corrupt", f"{name}: full tensor does not match its header entry")
            return TensorChange(name, "full", None, t)
        iv = INT_VIEW[TORCH_DTYPES[e.dtype]]
        if e.positions == "all":
            count, positions = e.numel, None
        elif e.positions == "classed":
            if base is None:
                raise DeltaError("format", f"{name}: positions are coded against the base; pass it")
            count = e.changed
            pos = decode_positions_classed(self._blob(name, POS), count,
                                           unsigned_view(base.contiguous()), TORCH_DTYPES[e.dtype])
            positions = torch.from_numpy(pos)
        else:
            count = e.changed
            pos = decode_positions(self._blob(name, POS), count, e.gap_bytes, e.numel,
                                   e.coders.get(POS, "zstd"))
            positions = torch.from_numpy(pos)
        vals = decode_value_bits(e.encoding, self._blob(name, VAL), count, UNSIGNED_NP[iv],
                                 e.coders.get(VAL, "zstd"), self._tables)
        return TensorChange(name, e.encoding, positions, torch.from_numpy(vals.view(SIGNED_NP[iv])))

    def decode(self, names: Iterable[str], base: Callable[[str], torch.Tensor] | None = None) -> list[TensorChange | None]:
        """:meth:`change` of each name, in order, through :meth:`decode_batches`."""
        names = list(names)
        batches, out = self.decode_batches(names, base)
        for batch in batches:
            out.update(zip(batch.names, batch.changes()))
        return [out[n] for n in names]

    def decode_batches(self, names: Iterable[str], base: Callable[[str], torch.Tensor] | None = None
                       ) -> tuple[list[DecodedBatch], dict[str, TensorChange | None]]:
        """The changes of ``names``: those with Rice-coded positions (the default) decoded
        together, one numba call per element width, values too where they are rANS-coded (a call
        per blob costs tens of microseconds of Python, most of decoding a delta of 0.1% of a
        model), and kept joined; the others by :meth:`change`, by name. ``base(name)`` is asked
        for only where positions are coded against the base."""
        single: dict[str, TensorChange | None] = {}
        batches: dict[torch.dtype, list[str]] = {}
        for name in names:
            e = self.header.tensors[name]
            if e.encoding in VALUE_CODERS and e.positions == "gaps" and e.coders.get(POS) == "rice":
                batches.setdefault(INT_VIEW[TORCH_DTYPES[e.dtype]], []).append(name)
            else:
                single[name] = self.change(name, base(name) if base and e.positions == "classed" else None)
        return [self._decode_sparse(members, iv) for iv, members in batches.items()], single

    def _decode_sparse(self, members: list[str], iv: torch.dtype) -> DecodedBatch:
        from .kernels import decode_sparse

        entries = [self.header.tensors[n] for n in members]
        modes = [e.encoding for e in entries]
        counts = np.array([e.changed for e in entries], dtype=np.int64)
        limits = np.array([math.prod(e.shape) for e in entries], dtype=np.int64)
        zig = np.array(modes) == "add"
        bounds = np.zeros(len(members) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        positions = buffers.empty(int(bounds[-1]), np.int64)
        values = buffers.empty(int(bounds[-1]), UNSIGNED_NP[iv])
        ans = [t for t, e in enumerate(entries) if e.coders.get(VAL) == "ans"]
        buf, lo, hi = self._spans([n + POS for n in members] + [members[t] + VAL for t in ans])
        pos_lo, pos_hi, val_lo, val_hi = lo[:len(members)], hi[:len(members)], lo[len(members):], hi[len(members):]
        tables = np.zeros((len(members), ALPHABET), dtype=np.uint16)
        code_at, raw_at, val_end = (np.full(len(members), -1, dtype=np.int64) for _ in range(3))
        tables[ans], code_at[ans], raw_at[ans] = ints_sections_many(buf, val_lo, val_hi, self._tables)
        val_end[ans] = val_hi
        for t in np.flatnonzero(code_at < 0).tolist():  # other value coders (new bits of a few elements: zstd)
            e = entries[t]
            values[bounds[t]:bounds[t + 1]] = decode_value_bits(
                e.encoding, self._blob(members[t], VAL), e.changed, UNSIGNED_NP[iv], e.coders.get(VAL, "zstd"),
                self._tables)
        failed, why = decode_sparse(buf, pos_lo, pos_hi, code_at, raw_at, val_end, tables, counts, limits, zig,
                                    torch.iinfo(iv).bits, positions, values)
        if failed >= 0:
            raise DeltaError("corrupt", f"{members[failed]}: {_sparse_failure(why, int(limits[failed]))}")
        return DecodedBatch(members, modes, bounds, torch.from_numpy(positions),
                            torch.from_numpy(values.view(SIGNED_NP[iv])))

    def changes(self, base: Callable[[str], torch.Tensor] | None = None) -> Iterator[TensorChange]:
        """Every change; ``base(name)`` is asked for a base tensor only where one is needed."""
        for name, e in self.header.tensors.items():
            c = self.change(name, base(name) if base and e.positions == "classed" else None)
            if c is not None:
                yield c

    def state(self) -> dict[str, torch.Tensor]:
        """All tensors of an anchor."""
        if self.header.kind != "anchor":
            raise DeltaError("format", "only an anchor holds a full state")
        return {c.name: c.bits for c in self.changes()}
