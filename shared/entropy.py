"""Entropy coding of non-negative integer sequences (position gaps, zigzagged differences).

Each value ``x`` becomes a symbol: ``x`` itself below 16, otherwise its bit length and the bit
after the leading one (a two-significant-bit float), whose remaining low bits are stored raw.
Symbols are coded with rANS (``constriction``) under a categorical model fitted to this very
sequence and sent with it (a zstd-compressed count table), so skewed distributions such as
"almost every change is one ulp" cost close to their entropy, which byte-oriented zstd is not.

Blob: ``<III`` (table bytes, ANS words, raw bytes), the table, the ANS words, the raw bits.
"""

from __future__ import annotations

import struct

import constriction
import numba
import numpy as np
import zstandard

from .errors import DeltaError

SMALL = 16
ALPHABET = SMALL + 2 * 60  # bit lengths 5..64, two symbols each
_HEAD = struct.Struct("<III")


@numba.njit(cache=True, nogil=True)
def _symbolize(x, sym, nraw):  # pragma: no cover
    total = 0
    for i in range(x.shape[0]):
        v = x[i]
        if v < SMALL:
            sym[i] = v
            nraw[i] = 0
        else:
            b = 0
            t = v
            while t:
                b += 1
                t >>= 1
            sym[i] = SMALL + 2 * (b - 5) + ((v >> (b - 2)) & 1)
            nraw[i] = b - 2
            total += b - 2
    return total


@numba.njit(cache=True, nogil=True)
def _pack(x, nraw, out):  # pragma: no cover
    """Append each value's low ``nraw`` bits, least significant first, into ``out``."""
    acc = np.uint64(0)
    filled = 0
    k = 0
    for i in range(x.shape[0]):
        n = nraw[i]
        if n == 0:
            continue
        v = x[i] & ((np.uint64(1) << np.uint64(n)) - np.uint64(1))
        acc |= v << np.uint64(filled)
        spill = filled + n - 64  # bits of v that did not fit in the accumulator
        filled += n
        while filled >= 8:
            out[k] = acc & np.uint64(0xFF)
            k += 1
            acc >>= np.uint64(8)
            filled -= 8
        if spill > 0:
            acc |= (v >> np.uint64(n - spill)) << np.uint64(filled - spill)
    if filled > 0:
        out[k] = acc & np.uint64(0xFF)


@numba.njit(cache=True, nogil=True)
def _unpack(sym, raw, out):  # pragma: no cover
    """Rebuild values; returns -1 if the raw bits run out (damaged input)."""
    bit = 0
    limit = raw.shape[0] * 8
    for i in range(sym.shape[0]):
        s = sym[i]
        if s < SMALL:
            out[i] = s
            continue
        n = (s - SMALL) // 2 + 3
        if bit + n > limit:
            return -1
        v = np.uint64(0)
        got = 0
        while got < n:
            byte = np.uint64(raw[bit >> 3]) >> np.uint64(bit & 7)
            take = min(8 - (bit & 7), n - got)
            v |= (byte & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))) << np.uint64(got)
            got += take
            bit += take
        out[i] = ((np.uint64(2) | np.uint64((s - SMALL) & 1)) << np.uint64(n)) | v
    return bit


def _model(counts: np.ndarray, used: np.ndarray):
    probs = counts[used].astype(np.float64) / counts[used].sum()
    return constriction.stream.model.Categorical(probs, perfect=False)


def encode_ints(x: np.ndarray) -> bytes:
    x = np.ascontiguousarray(x, dtype=np.uint64)
    sym = np.empty(x.shape[0], dtype=np.int32)
    nraw = np.empty(x.shape[0], dtype=np.uint8)
    total = _symbolize(x, sym, nraw)
    raw = np.zeros((total + 7) // 8, dtype=np.uint8)
    _pack(x, nraw, raw)
    counts = np.bincount(sym, minlength=ALPHABET).astype(np.uint32)
    table = zstandard.ZstdCompressor(level=19).compress(counts.astype("<u4").tobytes())
    words = np.empty(0, dtype=np.uint32)
    used = np.flatnonzero(counts)
    if used.shape[0] > 1:  # a single-symbol sequence needs no ANS bits at all
        coder = constriction.stream.stack.AnsCoder()
        lut = np.zeros(ALPHABET, dtype=np.int32)
        lut[used] = np.arange(used.shape[0], dtype=np.int32)
        coder.encode_reverse(lut[sym], _model(counts, used))
        words = coder.get_compressed()
    return b"".join([_HEAD.pack(len(table), words.shape[0], raw.shape[0]), table,
                     words.astype("<u4").tobytes(), raw.tobytes()])


def decode_ints(blob, count: int) -> np.ndarray:
    blob = memoryview(blob).cast("B")
    try:
        n_table, n_words, n_raw = _HEAD.unpack_from(blob, 0)
        at = _HEAD.size
        if at + n_table + 4 * n_words + n_raw != len(blob):
            raise ValueError("section sizes do not add up")
        counts = np.frombuffer(zstandard.ZstdDecompressor().decompress(
            blob[at:at + n_table], max_output_size=4 * ALPHABET), dtype="<u4")
        if counts.shape[0] != ALPHABET or int(counts.sum()) != count:
            raise ValueError("symbol table does not match the count")
        at += n_table
        words = np.frombuffer(blob[at:at + 4 * n_words], dtype="<u4").astype(np.uint32)
        raw = np.frombuffer(blob[at + 4 * n_words:], dtype=np.uint8)
        out = np.empty(count, dtype=np.uint64)
        if count == 0:
            return out
        counts = counts.astype(np.int64)
        used = np.flatnonzero(counts)
        if used.shape[0] > 1:
            dense = constriction.stream.stack.AnsCoder(words).decode(_model(counts, used), count)
            sym = used[dense].astype(np.int32)
        else:
            sym = np.full(count, used[0], dtype=np.int32)
        if _unpack(sym, raw, out) < 0:
            raise ValueError("raw bits run out")
        return out
    except Exception as e:  # constriction, zstd and numpy each raise their own kinds
        raise DeltaError("corrupt", f"entropy-coded blob: {e}") from None


# --------------------------------------------------------------------------- Rice codes
# Gaps between changed positions are close to geometric (each element changes independently
# with a similar probability), for which a Rice code is within a few hundredths of a bit of the
# entropy, needs no table, and decodes with a few integer operations per gap.

RICE_ESCAPE = 40  # a quotient this large is written as the escape run plus 64 raw bits


@numba.njit(cache=True, nogil=True, inline="always")
def _put(out, n, acc, filled, bits, nbits):  # pragma: no cover
    """Append ``nbits`` (<= 64) low bits of ``bits``; returns the writer's new state."""
    if nbits == 0:
        return n, acc, filled
    acc |= bits << np.uint64(filled)
    spill = filled + nbits - 64
    filled += nbits
    while filled >= 8:
        out[n] = acc & np.uint64(0xFF)
        n += 1
        acc >>= np.uint64(8)
        filled -= 8
    if spill > 0:
        acc |= (bits >> np.uint64(nbits - spill)) << np.uint64(filled - spill)
    return n, acc, filled


@numba.njit(cache=True, nogil=True)
def _rice_pack(x, k, out):  # pragma: no cover
    n, acc, filled = 0, np.uint64(0), 0
    mask = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
    for i in range(x.shape[0]):
        v = x[i]
        q = v >> np.uint64(k)
        if q >= RICE_ESCAPE:  # the escape run of ones, a zero, then all 64 bits
            n, acc, filled = _put(out, n, acc, filled, np.uint64((1 << RICE_ESCAPE) - 1), RICE_ESCAPE + 1)
            n, acc, filled = _put(out, n, acc, filled, v & np.uint64(0xFFFFFFFF), 32)
            n, acc, filled = _put(out, n, acc, filled, v >> np.uint64(32), 32)
        else:
            n, acc, filled = _put(out, n, acc, filled, (np.uint64(1) << q) - np.uint64(1), int(q) + 1)
            n, acc, filled = _put(out, n, acc, filled, v & mask, k)
    if filled > 0:
        out[n] = acc & np.uint64(0xFF)
        n += 1
    return n


@numba.njit(cache=True, nogil=True)
def _read_bits(buf, bit, n):  # pragma: no cover
    v = np.uint64(0)
    got = 0
    while got < n:
        byte = np.uint64(buf[bit >> 3]) >> np.uint64(bit & 7)
        take = min(8 - (bit & 7), n - got)
        v |= (byte & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))) << np.uint64(got)
        got += take
        bit += take
    return v


@numba.njit(cache=True, nogil=True)
def _rice_unpack(buf, k, count, out):  # pragma: no cover
    """Returns the bits read, or -1 if the input runs out (damaged)."""
    bit = 0
    limit = buf.shape[0] * 8
    for i in range(count):
        q = 0
        while True:
            if bit >= limit:
                return -1
            if (buf[bit >> 3] >> (bit & 7)) & 1:
                q += 1
                bit += 1
                if q > RICE_ESCAPE:
                    return -1
            else:
                bit += 1
                break
        if q == RICE_ESCAPE:
            if bit + 64 > limit:
                return -1
            out[i] = _read_bits(buf, bit, 32) | (_read_bits(buf, bit + 32, 32) << np.uint64(32))
            bit += 64
        else:
            if bit + k > limit:
                return -1
            out[i] = (np.uint64(q) << np.uint64(k)) | _read_bits(buf, bit, k)
            bit += k
    return bit


def rice_encode(x: np.ndarray) -> bytes:
    """One byte of ``k``, then the codes. ``k`` is the size-minimising Rice parameter."""
    x = np.ascontiguousarray(x, dtype=np.uint64)
    mean = float(x.mean()) if x.shape[0] else 0.0
    k0 = max(0, int(np.log2(max(mean * 0.69, 1.0))))
    sizes = {k: int(np.minimum(x >> np.uint64(k), RICE_ESCAPE).sum()) + x.shape[0] * (k + 1)
             for k in range(max(0, k0 - 1), min(63, k0 + 2))}
    k = min(sizes, key=sizes.get)
    out = np.zeros(sizes[k] // 8 + 9 * int((x >> np.uint64(k) >= RICE_ESCAPE).sum()) + 2, dtype=np.uint8)
    n = _rice_pack(x, k, out)
    return bytes([k]) + out[:n].tobytes()


def rice_decode(blob, count: int) -> np.ndarray:
    buf = np.frombuffer(memoryview(blob).cast("B"), dtype=np.uint8)
    if buf.shape[0] < 1 or buf[0] > 63:
        raise DeltaError("corrupt", "Rice parameter out of range")
    out = np.empty(count, dtype=np.uint64)
    if _rice_unpack(buf[1:], int(buf[0]), count, out) < 0:
        raise DeltaError("corrupt", "Rice-coded blob ends early")
    return out
