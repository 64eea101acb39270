"""Entropy coding of non-negative integer sequences (position gaps, zigzagged differences).

Each value ``x`` becomes a symbol: ``x`` itself below 16, otherwise its bit length and the bit
after the leading one (a two-significant-bit float), whose remaining low bits are stored raw.
Symbols are coded with rANS (numba, :mod:`shared.kernels`) under frequencies fitted to this
very sequence and sent with it (a table of 12-bit frequencies), so skewed distributions such as
"almost every change is one ulp" cost close to their entropy, which byte-oriented zstd is not.

Blob: ``<III`` (table bytes, code bytes, raw bytes), the table, the rANS code, the raw bits. The
table is coded by :func:`shared.kernels.table_code` (``tables="gamma"``, format 4: the used
symbols and their frequencies in Elias-gamma codes), or, in files of format 3, is a zstd frame
of the 136 frequencies as ``<u2`` (``tables="zstd"``), which is still read.
"""

from __future__ import annotations

import struct
import threading
from typing import Literal

import numpy as np
import zstandard

from .errors import DeltaError

ZSTD_LEVEL = 3
SMALL = 16
ALPHABET = SMALL + 2 * 60  # bit lengths 5..64, two symbols each
_HEAD = struct.Struct("<III")
TableCoding = Literal["gamma", "zstd"]


_ZSTD = threading.local()  # contexts are costly to make and not thread-safe: one per thread


def zstd_compress(data) -> bytes:
    if not hasattr(_ZSTD, "c"):
        _ZSTD.c = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return _ZSTD.c.compress(data)


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_ZSTD, "d"):
        _ZSTD.d = zstandard.ZstdDecompressor()
    return _ZSTD.d


def zstd_decompress(blob, size: int) -> bytes:
    try:
        # a frame that declares its size is decompressed into that much memory whatever
        # max_output_size says: a damaged size field would ask for terabytes (MemoryError)
        declared = zstandard.frame_content_size(blob)
        if declared not in (-1, size):
            raise DeltaError("corrupt", f"zstd frame declares {declared} bytes, expected {size}")
        out = _decompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as e:
        raise DeltaError("corrupt", f"zstd: {e}") from None
    if len(out) != size:
        raise DeltaError("corrupt", f"decompressed {len(out)} bytes, expected {size}")
    return out


def encode_ints(x: np.ndarray, zigzag: bool = False) -> bytes:
    """Symbols' frequencies (rounded half to even to sum to ``2**PROB_BITS``, every used symbol
    at least 1), their rANS code and the raw bits, as one blob made in one kernel call (its
    parts one by one cost ~35 us of numpy calls a blob). ``x``: unsigned ints; with ``zigzag``,
    the bits of signed ints of their width, coded as their zigzag (0, -1, 1, -2 -> 0, 1, 2, 3)."""
    from . import kernels

    x = np.ascontiguousarray(x)
    if x.dtype.kind != "u":
        raise TypeError(f"encode_ints takes unsigned ints, not {x.dtype}")
    blob, ok = kernels.encode_ints_blob(x, zigzag, ALPHABET)
    if not ok:
        raise ValueError("cannot quantise these counts")
    return blob.tobytes()


def decode_ints(blob, count: int, tables: TableCoding = "gamma") -> np.ndarray:
    return decode_ints_into(blob, np.empty(count, dtype=np.uint64), tables=tables)


def ints_sections(blob, tables: TableCoding = "gamma") -> tuple[np.ndarray, int, int]:
    """An entropy-coded blob's symbol frequencies, and where its rANS code and its raw bits start."""
    from . import kernels

    try:
        n_table, n_code, n_raw = _HEAD.unpack_from(blob, 0)
    except struct.error as e:
        raise DeltaError("corrupt", f"entropy-coded blob: {e}") from None
    at = _HEAD.size
    if at + n_table + n_code + n_raw != len(blob):
        raise DeltaError("corrupt", "entropy-coded blob: section sizes do not add up")
    if tables == "zstd":
        table = np.frombuffer(zstd_decompress(blob[at:at + n_table], 2 * ALPHABET), dtype="<u2")
    else:
        table = np.empty(ALPHABET, dtype=np.uint16)
        if not kernels.table_decode(np.frombuffer(blob[at:at + n_table], dtype=np.uint8), table):
            raise DeltaError("corrupt", "entropy-coded blob: damaged symbol table")
    return table, at + n_table, at + n_table + n_code


def ints_sections_many(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, tables: TableCoding = "gamma"
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`ints_sections` of the blobs ``buf[starts[t]:ends[t]]``: their tables (one row each),
    and where their codes and raw bits start in ``buf``. The heads are read with numpy and the
    tables decoded in one call: a delta of 0.1% of a model holds a hundred or more blobs, and
    a Python call each took ~5 us. Damage is named by :func:`ints_sections`, blob by blob, which
    the fast path falls back to on any error."""
    from . import kernels

    n = starts.shape[0]
    out = np.empty((n, ALPHABET), dtype=np.uint16)
    code_at, raw_at = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    try:
        if n and not np.all(ends - starts >= _HEAD.size):
            raise ValueError("a blob shorter than its head")
        heads = buf[starts[:, None] + np.arange(_HEAD.size)].view("<u4").reshape(n, 3).astype(np.int64)
        if not np.array_equal(heads.sum(axis=1) + _HEAD.size, ends - starts):
            raise ValueError("section sizes do not add up")
        code_at[:] = starts + _HEAD.size + heads[:, 0]
        raw_at[:] = code_at + heads[:, 1]
        if n and tables == "zstd":
            frames = zstandard.BufferWithSegments(
                buf, np.stack([starts + _HEAD.size, heads[:, 0]], axis=1).astype("=u8").tobytes())
            size = 2 * ALPHABET
            got = _decompressor().multi_decompress_to_buffer(frames, decompressed_sizes=np.full(n, size, "=u8").tobytes())
            if got.size() != n * size:
                raise ValueError("a table of the wrong size")
            out[:] = np.frombuffer(b"".join(got[i] for i in range(n)), dtype="<u2").reshape(n, ALPHABET)
        elif n and kernels.table_decode_many(buf, starts + _HEAD.size, code_at, out) >= 0:
            raise ValueError("a damaged table")
        return out, code_at, raw_at
    except Exception:  # noqa: BLE001 - zstd's and numpy's errors alike: the slow path names the damage
        for t in range(n):
            out[t], code, raw = ints_sections(buf[starts[t]:ends[t]], tables)
            code_at[t], raw_at[t] = starts[t] + code, starts[t] + raw
        return out, code_at, raw_at


def decode_ints_into(blob, out: np.ndarray, zigzag: bool = False, tables: TableCoding = "gamma") -> np.ndarray:
    """Decode ``len(out)`` values into the unsigned ``out`` (elements' width: a wider value is
    damage), or with ``zigzag`` the signed values they zigzag-code, wrapping into ``out``."""
    from . import kernels

    blob = memoryview(blob).cast("B")
    table, code_at, raw_at = ints_sections(blob, tables)
    if out.shape[0] == 0:
        return out
    try:
        code = np.frombuffer(blob[code_at:raw_at], dtype=np.uint8)
        raw = np.frombuffer(blob[raw_at:], dtype=np.uint8)
        status = kernels.rans_decode_values(code, table, raw, zigzag, 8 * out.itemsize, out,
                                            np.empty(1 << kernels.PROB_BITS, dtype=np.uint64))
        if status:
            raise ValueError({-1: "the code or its raw bits run out", -2: "value wider than its element",
                              -3: "symbol table does not add up"}[status])
        return out
    except (ValueError, struct.error) as e:
        raise DeltaError("corrupt", f"entropy-coded blob: {e}") from None


# --------------------------------------------------------------------------- Rice codes
# Gaps between changed positions are close to geometric (each element changes independently
# with a similar probability), for which a Rice code is within a few hundredths of a bit of the
# entropy, needs no table, and decodes with a few integer operations per gap.

# A quotient of RICE_ESCAPE (kernels.py) is followed by the value's 64 raw bits.


def rice_encode(x: np.ndarray, running: bool = False) -> bytes:
    """One byte of ``k``, then the codes. ``k`` is the size-minimising Rice parameter, counted
    exactly for the three around the one the mean value suggests.

    With ``running``, ``x`` are sorted int64 positions and the code is of their gaps
    (``x[i] - x[i-1] - 1``, the first from -1), which are never materialised."""
    from . import kernels

    k, code = kernels.rice_auto(np.ascontiguousarray(x, dtype=np.int64 if running else np.uint64), running)
    return bytes([k]) + code.tobytes()


def rice_decode(blob, count: int, running: bool = False, limit: int = 1 << 62) -> np.ndarray:
    """The values, or with ``running`` the int64 positions they are the gaps of, checked to be
    strictly increasing and below ``limit``."""
    from . import kernels

    buf = np.frombuffer(memoryview(blob).cast("B"), dtype=np.uint8)
    if buf.shape[0] < 1 or buf[0] > 56:
        raise DeltaError("corrupt", "Rice parameter out of range")
    out = np.empty(count, dtype=np.int64 if running else np.uint64)
    status = kernels.rice_unpack(buf[1:], int(buf[0]), count, out, running, min(limit, 1 << 62))
    if status == -2:
        raise DeltaError("corrupt", f"positions run outside a tensor of {limit} elements")
    if status < 0:
        raise DeltaError("corrupt", "Rice-coded blob ends early")
    return out
