"""Entropy coding of non-negative integer sequences (position gaps, zigzagged differences).

Each value ``x`` becomes a symbol: ``x`` itself below 16, otherwise its bit length and the bit
after the leading one (a two-significant-bit float), whose remaining low bits are stored raw.
Symbols are coded with rANS (numba, :mod:`shared.kernels`) under frequencies fitted to this
very sequence and sent with it (a zstd-compressed table of 12-bit frequencies), so skewed
distributions such as "almost every change is one ulp" cost close to their entropy, which
byte-oriented zstd is not.

Blob: ``<III`` (table bytes, code bytes, raw bytes), the table, the rANS code, the raw bits.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from .errors import DeltaError

ZSTD_LEVEL = 3
SMALL = 16
ALPHABET = SMALL + 2 * 60  # bit lengths 5..64, two symbols each
_HEAD = struct.Struct("<III")


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
    at least 1), their rANS code and the raw bits, in one kernel call (its parts one by one
    cost ~35 us of numpy calls a blob). ``x``: unsigned ints; with ``zigzag``, the bits of
    signed ints of their width, coded as their zigzag (0, -1, 1, -2 -> 0, 1, 2, 3)."""
    from . import kernels

    x = np.ascontiguousarray(x)
    if x.dtype.kind != "u":
        raise TypeError(f"encode_ints takes unsigned ints, not {x.dtype}")
    freq, code, raw, ok = kernels.encode_ints_parts(x, zigzag, ALPHABET)
    if not ok:
        raise ValueError("cannot quantise these counts")
    return ints_blob(freq, code, raw)


def ints_blob(freq: np.ndarray, code: np.ndarray, raw: np.ndarray) -> bytes:
    """The blob of :func:`encode_ints` from its parts: symbol frequencies, rANS code, raw bits."""
    return b"".join([ints_head(freq, code.shape[0], raw.shape[0]), code, raw])


def ints_head(freq: np.ndarray, code_bytes: int, raw_bytes: int) -> bytes:
    """What an :func:`encode_ints` blob holds before its rANS code: the section sizes and the
    compressed symbol frequencies."""
    table = zstd_compress(freq.astype("<u2").tobytes())
    return _HEAD.pack(len(table), code_bytes, raw_bytes) + table


def decode_ints(blob, count: int) -> np.ndarray:
    return decode_ints_into(blob, np.empty(count, dtype=np.uint64))


def ints_sections(blob) -> tuple[np.ndarray, int, int]:
    """An entropy-coded blob's symbol frequencies, and where its rANS code and its raw bits start."""
    try:
        n_table, n_code, n_raw = _HEAD.unpack_from(blob, 0)
    except struct.error as e:
        raise DeltaError("corrupt", f"entropy-coded blob: {e}") from None
    at = _HEAD.size
    if at + n_table + n_code + n_raw != len(blob):
        raise DeltaError("corrupt", "entropy-coded blob: section sizes do not add up")
    table = np.frombuffer(zstd_decompress(blob[at:at + n_table], 2 * ALPHABET), dtype="<u2")
    return table, at + n_table, at + n_table + n_code


def ints_sections_many(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`ints_sections` of the blobs ``buf[starts[t]:ends[t]]``: their tables (one row each),
    and where their codes and raw bits start in ``buf``. The heads are read with numpy and the
    tables decompressed in one zstd call: a delta of 0.1% of a model holds a hundred or more
    blobs, and a Python call each took ~5 us. Damage is named by :func:`ints_sections`, blob by
    blob, which the fast path falls back to on any error."""
    n = starts.shape[0]
    tables = np.empty((n, ALPHABET), dtype=np.uint16)
    code_at, raw_at = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    try:
        if n and not np.all(ends - starts >= _HEAD.size):
            raise ValueError("a blob shorter than its head")
        heads = buf[starts[:, None] + np.arange(_HEAD.size)].view("<u4").reshape(n, 3).astype(np.int64)
        if not np.array_equal(heads.sum(axis=1) + _HEAD.size, ends - starts):
            raise ValueError("section sizes do not add up")
        code_at[:] = starts + _HEAD.size + heads[:, 0]
        raw_at[:] = code_at + heads[:, 1]
        if n:
            frames = zstandard.BufferWithSegments(
                buf, np.stack([starts + _HEAD.size, heads[:, 0]], axis=1).astype("=u8").tobytes())
            size = 2 * ALPHABET
            out = _decompressor().multi_decompress_to_buffer(frames, decompressed_sizes=np.full(n, size, "=u8").tobytes())
            if out.size() != n * size:
                raise ValueError("a table of the wrong size")
            tables[:] = np.frombuffer(b"".join(out[i] for i in range(n)), dtype="<u2").reshape(n, ALPHABET)
        return tables, code_at, raw_at
    except Exception:  # noqa: BLE001 - zstd's and numpy's errors alike: the slow path names the damage
        for t in range(n):
            tables[t], code, raw = ints_sections(buf[starts[t]:ends[t]])
            code_at[t], raw_at[t] = starts[t] + code, starts[t] + raw
        return tables, code_at, raw_at


def decode_ints_into(blob, out: np.ndarray, zigzag: bool = False) -> np.ndarray:
    """Decode ``len(out)`` values into the unsigned ``out`` (elements' width: a wider value is
    damage), or with ``zigzag`` the signed values they zigzag-code, wrapping into ``out``."""
    from . import kernels

    blob = memoryview(blob).cast("B")
    table, code_at, raw_at = ints_sections(blob)
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
    return rice_blob(k, code)


def rice_blob(k: int, code: np.ndarray) -> bytes:
    """The blob of :func:`rice_encode` from its parts: the parameter's byte, then the code."""
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
