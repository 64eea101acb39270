"""Numba kernels for the hot loops: one pass each, GIL released so callers can use threads.

Kept tiny and free of policy: they see flat integer arrays only. Import this module lazily
(inside functions): importing numba before a vLLM engine starts in the same process breaks
vLLM's kernel discovery, and ``shared`` is imported by the rollout server.
"""

from __future__ import annotations

import math
import sys

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros
from numba.core import cgutils
from numba.extending import intrinsic


@numba.njit(cache=True, nogil=True)
def xor_scatter(target, positions, bits, offset):  # pragma: no cover
    """``target[positions - offset] ^= bits`` in one read-modify-write pass (its own inverse;
    ``offset``: where ``target`` starts when it is a slice and the positions are global)."""
    for i in range(positions.shape[0]):
        target[positions[i] - offset] ^= bits[i]


SCAN_BLOCK = 64  # elements compared at once: one bit each in a 64-bit mask
if sys.byteorder != "little":  # _mask reads a word's bytes in little-endian order
    raise ImportError("shared.kernels needs a little-endian machine")
_PACK = np.uint64(0x0102040810204080)  # gathers the low bits of a word's 8 bytes into its top byte


@numba.njit(cache=True, nogil=True, inline="always")
def _mask(flags, words):  # pragma: no cover
    """The block's 64 one-byte flags (0 or 1; ``words`` is ``flags`` viewed as 8 uint64) as a
    64-bit mask, bit j for flag j: 8 multiplies (each moves byte i's low bit to bit 56 + i,
    without carries) instead of a shift and an OR per element, which is what LLVM made of
    ``m |= flag << j`` (x86 and other little-endian targets: byte i of a word is bits 8i..8i+7)."""
    m = np.uint64(0)
    for q in range(SCAN_BLOCK // 8):
        m |= ((words[q] * _PACK) >> np.uint64(56)) << np.uint64(8 * q)
    return m


@numba.njit(cache=True, nogil=True)
def scan_changes(old, new, out_pos, out_xor, out_new, offset, update):  # pragma: no cover
    """Record positions (``offset`` added), XORs and new bits of the elements whose bits differ; with
    ``update``, refresh ``old`` to ``new`` in the same pass, element by element while it is in
    cache (a second pass over the positions costs a cache miss per change).

    Elements go in blocks of ``SCAN_BLOCK``: one vectorised loop compares a block into a byte
    per element, packed into a bit mask (:func:`_mask`); a clean block costs nothing more, and
    a dirty one is walked bit by bit (trailing-zero count), so the work per change is a few
    instructions and the only mispredicted branch is a block's last bit. On one thread this ran
    at the memory's read speed at 0.1% changed and 1.6-2.7x faster than the word groups it
    replaced at 1-5% (25M bf16 elements); the packed mask took another 10-15% off at 0-5%
    (40M, one thread). The block loop must count blocks, not step through elements: with
    ``range(0, n, 64)`` numba did not vectorise the compare (4x slower). The new bits are
    recorded while in a register: the encoder would otherwise gather them back from the
    refreshed snapshot, a cache miss per change (~20 ns, a third of its time at 1% changed of 61M
    bf16 elements). Returns the number of
    changes, or ``len(out_pos) + 1`` once there are more, and then this call's refresh has been
    taken back (``old`` is as it was).
    """
    cap = out_pos.shape[0]
    k = 0
    blocks = old.shape[0] // SCAN_BLOCK
    flags = np.zeros(SCAN_BLOCK, dtype=np.uint8)
    words = flags.view(np.uint64)
    for b in range(blocks + 1):
        base = b * SCAN_BLOCK
        if b < blocks:
            for j in range(SCAN_BLOCK):
                flags[j] = old[base + j] != new[base + j]
        else:  # the last, partial block
            flags[:] = 0
            for j in range(old.shape[0] - base):
                flags[j] = old[base + j] != new[base + j]
        m = _mask(flags, words)
        while m:
            i = base + trailing_zeros(m)
            if k >= cap:
                if update:
                    xor_scatter(old, out_pos[:k], out_xor[:k], offset)
                return cap + 1
            out_pos[k] = offset + i
            out_xor[k] = old[i] ^ new[i]
            out_new[k] = new[i]
            if update:
                old[i] = new[i]
            k += 1
            m &= m - np.uint64(1)
    return k


@numba.njit(cache=True, nogil=True)
def xor_refresh(old, new, out, update):  # pragma: no cover
    """``out = old ^ new`` and, with ``update``, ``old = new``, in one pass: a dense change's
    XOR and the snapshot's refresh (separate numpy and torch passes read both twice more).
    Returns the number of elements that differ."""
    k = 0
    for i in range(old.shape[0]):
        x = old[i] ^ new[i]
        out[i] = x
        k += x != 0
        if update:
            old[i] = new[i]
    return k


_U32 = np.uint32


@numba.njit(cache=True, nogil=True, inline="always")
def _bf16_bits(u):  # pragma: no cover
    """fp32 bits to bf16 bits, rounding to nearest even (exact where ``_not_cast`` is 0). Every
    step is cast back to 32 bits: numba widens integer arithmetic to 64 bits, and then LLVM
    vectorised the scans' cast in 4 lanes a register instead of 8 (19-29% slower)."""
    return np.uint16(_U32(_U32(u + _U32(_U32(u >> _U32(16)) & _U32(1))) + _U32(0x7FFF)) >> _U32(16))


@numba.njit(cache=True, nogil=True, inline="always")
def _not_cast(u):  # pragma: no cover
    """1 for a NaN or a subnormal, else 0; without branches, so a loop of it vectorises."""
    e = u & np.uint32(0x7F800000)
    return (np.uint32(e == np.uint32(0x7F800000)) | np.uint32(e == 0)) & np.uint32((u & np.uint32(0x007FFFFF)) != 0)


@numba.njit(cache=True, nogil=True, inline="always")
def _edge(u):  # pragma: no cover
    """1 where the exponent is all zeros or all ones (zero, subnormal, infinity, NaN), else 0:
    one test cheaper than :func:`_not_cast`, which then looks closer at a block it flags (32-bit
    steps, as in :func:`_bf16_bits`)."""
    return _U32(_U32(_U32(u & _U32(0x7F800000)) - _U32(0x00800000)) >= _U32(0x7F000000))


@numba.njit(cache=True, nogil=True)
def scan_cast_bf16(live, old, out_pos, out_xor, out_new, offset, update):  # pragma: no cover
    """:func:`scan_changes` of fp32 ``live`` (uint32 bits) cast to bf16 against bf16 ``old``
    (uint16 bits), the cast fused in: round to nearest even, exact for every finite normal
    value, zero and infinity. Returns -1 if any element is a NaN or a subnormal (torch's NaN
    bits and subnormal handling differ between its CPU code paths, so the caller casts with
    torch then), ``len(out_pos) + 1`` on overflow, else the number of changes. ``update``
    refreshes ``old`` in the same pass, taken back when it returns -1 or overflows.

    Blocks and packed masks as in :func:`scan_changes`, the cast computed for the whole block
    without a branch (1.7x faster at 0-1% changed, 25M elements, than a branch per element); a
    changed element's cast is recomputed when it is recorded. The NaN/subnormal test runs as
    the cheaper :func:`_edge` in the block loop and exactly only on a block it flags (zeros and
    infinities): with the packed mask, 15-20% faster at 0-5% changed (40M, one thread), and
    another 19-29% with the cast in 32-bit lanes (:func:`_bf16_bits`): at 0% changed it then
    reads at about the memory's speed.
    """
    cap = out_pos.shape[0]
    k = 0
    blocks = live.shape[0] // SCAN_BLOCK
    flags = np.zeros(SCAN_BLOCK, dtype=np.uint8)
    words = flags.view(np.uint64)
    for b in range(blocks + 1):
        base = b * SCAN_BLOCK
        edge = np.uint32(0)
        width = SCAN_BLOCK
        if b < blocks:
            for j in range(SCAN_BLOCK):
                u = live[base + j]
                edge |= _edge(u)
                flags[j] = old[base + j] != _bf16_bits(u)
        else:  # the last, partial block
            width = live.shape[0] - base
            flags[:] = 0
            for j in range(width):
                u = live[base + j]
                edge |= _edge(u)
                flags[j] = old[base + j] != _bf16_bits(u)
        if edge:
            bad = np.uint32(0)
            for j in range(width):
                bad |= _not_cast(live[base + j])
            if bad:
                if update:
                    xor_scatter(old, out_pos[:k], out_xor[:k], offset)
                return -1
        m = _mask(flags, words)
        while m:
            i = base + trailing_zeros(m)
            if k >= cap:
                if update:
                    xor_scatter(old, out_pos[:k], out_xor[:k], offset)
                return cap + 1
            c = _bf16_bits(live[i])
            out_pos[k] = offset + i
            out_xor[k] = old[i] ^ c
            out_new[k] = c
            if update:
                old[i] = c
            k += 1
            m &= m - np.uint64(1)
    return k


@intrinsic
def address_as(typingctx, address, like):  # pragma: no cover - a numba intrinsic
    """A pointer to elements of ``like``'s type at the integer ``address`` (a tensor's
    ``data_ptr()``): how one kernel call reaches many tensors that are not one array."""
    signature = numba.types.CPointer(like.dtype)(address, like)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return signature, codegen


@intrinsic
def copy_bytes(typingctx, dest, source, count):  # pragma: no cover - a numba intrinsic
    """``memcpy`` of ``count`` bytes between integer addresses: numba's loops and slice
    assignments from a raw address copied about a byte a nanosecond."""
    signature = numba.types.void(dest, source, count)

    def codegen(context, builder, sig, args):
        byte = context.get_value_type(numba.types.CPointer(numba.types.uint8))
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], byte), builder.inttoptr(args[1], byte), args[2], 1)

    return signature, codegen


@numba.njit(cache=True, nogil=True)
def scan_many(table, old_like, new_like, chunk, max_fraction, out_pos, out_xor, out_new, counts, update,
              cast):  # pragma: no cover
    """:func:`scan_changes` (``cast``: :func:`scan_cast_bf16`) of many tensors in one call, tensor
    ``k`` at ``table[k]`` = (address of its old bits, of its new bits, its element count), its
    elements of ``old_like``'s and ``new_like``'s types. Each chunk of ``chunk`` elements may hold
    at most ``int(len * max_fraction) + 1`` changes (the dense-change rule of
    ``shared.changes``). Tensor ``k``'s changes land right after tensor ``k - 1``'s, and
    ``counts[k]`` is their number, or -1 when a chunk is over its cap, -2 (``cast``) at a NaN or
    subnormal; then its refresh has been taken back. The outputs must hold the sum of every
    chunk's cap. Returns the number of changes recorded."""
    k = 0
    for t in range(table.shape[0]):
        n = table[t, 2]
        old = numba.carray(address_as(table[t, 0], old_like), n)
        new = numba.carray(address_as(table[t, 1], new_like), n)
        start = k
        counts[t] = 0
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            cap = int((e - s) * max_fraction) + 1
            if cast:
                r = scan_cast_bf16(new[s:e], old[s:e], out_pos[k:k + cap], out_xor[k:k + cap], out_new[k:k + cap],
                                   s, update)
            else:
                r = scan_changes(old[s:e], new[s:e], out_pos[k:k + cap], out_xor[k:k + cap], out_new[k:k + cap],
                                 s, update)
            if r < 0 or r > cap:  # the chunk took back its own refresh; the tensor's earlier ones
                if update:
                    xor_scatter(old, out_pos[start:k], out_xor[start:k], 0)
                counts[t] = -2 if r < 0 else -1
                k = start
                break
            k += r
        if counts[t] == 0:
            counts[t] = k - start
    return k


@numba.njit(cache=True, nogil=True)
def gather_many(table, like, starts, positions, out):  # pragma: no cover
    """``out[j] = tensor k's element positions[j]`` for ``j`` in ``starts[k]:starts[k + 1]``, tensor
    ``k`` at ``table[k]`` = (address of its bits, its element count), its elements of ``like``'s
    type. Returns -1, or the first ``k`` with a position outside its tensor (``out`` then holds
    garbage)."""
    for k in range(table.shape[0]):
        src = numba.carray(address_as(table[k, 0], like), table[k, 1])
        for j in range(starts[k], starts[k + 1]):
            p = positions[j]
            if p < 0 or p >= table[k, 1]:
                return k
            out[j] = src[p]
    return -1


@numba.njit(cache=True, nogil=True)
def equal_at_many(table, like, out):  # pragma: no cover
    """``out[k]`` = 1 where tensor ``k`` holds its expected bits at its positions, else 0 (also
    for a position outside it): ``table[k]`` = (address of its elements, their count, address of
    its int64 positions, of the expected bits, their count), elements of ``like``'s type. The
    read-back of a replica's write: one call for every patch of a width, where ``index_select``
    and ``torch.equal`` per patch allocated a copy and cost ~10 us of calls a patch."""
    for k in range(table.shape[0]):
        n, count = table[k, 1], table[k, 4]
        target = numba.carray(address_as(table[k, 0], like), n)
        positions = numba.carray(address_as(table[k, 2], table[:, 0]), count)
        bits = numba.carray(address_as(table[k, 3], like), count)
        ok = 1
        for j in range(count):
            p = positions[j]
            if p < 0 or p >= n or target[p] != bits[j]:
                ok = 0
                break
        out[k] = ok


@numba.njit(cache=True, nogil=True)
def join_named(table, names, out):  # pragma: no cover
    """Blob ``k``'s name (``names[table[k, 2]:table[k, 3]]``), a NUL and its bytes (``table[k, 1]``
    of them at address ``table[k, 0]``) for each ``k`` in turn, into ``out``: the payload
    digest's input in one call, where a Python step per blob cost more than hashing it."""
    at = 0
    for k in range(table.shape[0]):
        for j in range(table[k, 2], table[k, 3]):
            out[at] = names[j]
            at += 1
        out[at] = 0
        copy_bytes(out.ctypes.data + at + 1, table[k, 0], table[k, 1])
        at += 1 + table[k, 1]
    return at


@numba.njit(cache=True, nogil=True)
def gaps_to_positions(planes, count, nbytes, out):  # pragma: no cover
    """Byte planes of gaps (plane b holds byte b of every gap) to absolute positions."""
    pos = -1
    for i in range(count):
        g = 0
        for b in range(nbytes):
            g |= np.int64(planes[b * count + i]) << (8 * b)
        pos += g + 1
        out[i] = pos
    return pos


@numba.njit(cache=True, nogil=True, inline="always")
def _gap(positions, i):  # pragma: no cover
    """The gap before sorted position ``i``: the unchanged elements since the one before it
    (the first from -1)."""
    return positions[i] - (positions[i - 1] if i else -1) - 1


@numba.njit(cache=True, nogil=True)
def max_gap(positions):  # pragma: no cover
    top = 0
    for i in range(positions.shape[0]):
        top = max(top, _gap(positions, i))
    return top


@numba.njit(cache=True, nogil=True)
def gap_runs(positions, limit):  # pragma: no cover
    """Structure in the gaps of sorted ``positions``: how many are 0 (adjacent changes), how
    many equal the gap before them (runs, strides), and, among the first ``limit``, how many
    three consecutive gaps repeat three seen earlier (a pattern of any period, as when the same
    columns change in every row; by 64-bit hash)."""
    n = positions.shape[0]
    zeros, repeats, before = 0, 0, np.int64(-1)
    for i in range(n):
        g = _gap(positions, i)
        zeros += np.int64(g == 0)
        repeats += np.int64(g == before)
        before = g
    m = min(n, limit)
    size = 4
    while size < 2 * m:
        size *= 2
    slots = np.zeros(size, dtype=np.uint64)  # 64-bit hashes of the triples seen (odd: 0 is empty)
    triples = 0
    for i in range(2, m):
        h = (np.uint64(_gap(positions, i - 2) * 0x9E3779B1 + _gap(positions, i - 1)) * np.uint64(0x9E3779B97F4A7C15)
             + np.uint64(_gap(positions, i))) * np.uint64(0xC2B2AE3D27D4EB4F) | np.uint64(1)
        at = np.int64(h >> np.uint64(40)) & (size - 1)
        while slots[at] and slots[at] != h:  # open addressing
            at = (at + 1) & (size - 1)
        triples += np.int64(slots[at] == h)  # equal hashes taken as equal triples: at worst a wasted trial
        slots[at] = h
    return zeros, repeats, triples


@numba.njit(cache=True, nogil=True)
def zstd_may_win(positions, rice_bytes, limit):  # pragma: no cover
    """``codec._zstd_may_win`` (its docstring says why): whether the gaps of sorted ``positions``
    hold more structure than their Rice code of ``rice_bytes`` takes in, judged on
    :func:`gap_runs` of the first ``limit``."""
    n = positions.shape[0]
    if n < 2:
        return False  # a zstd frame alone outweighs a Rice code of one gap
    zeros, repeats, triples = gap_runs(positions, limit)
    mean = (positions[n - 1] + 1 - n) / n
    p = 1 / (mean + 1)  # of a gap being 0
    same = p / (2 - p)  # of two independent gaps being equal
    m, q = min(n, limit), same * same * same
    # of the m triples, how many repeat an earlier one by chance
    chance = m + math.expm1(m * math.log1p(-q)) / q if 0 < q < 1 else 0.0
    if chance > m / 8:  # changes so dense that patterns repeat by chance: the count cannot tell
        return True
    if zeros > 2 * n * p + 16 or repeats > 2 * n * same + 16 or triples > 2 * chance + 16:
        return True
    entropy_bits = math.log2(mean + 1) + (mean * math.log2((mean + 1) / mean) if mean > 0 else 0.0)
    return rice_bytes > 1.1 * n * entropy_bits / 8 + 16


@numba.njit(cache=True, nogil=True)
def positions_to_gaps(positions, nbytes, planes):  # pragma: no cover
    """Inverse of :func:`gaps_to_positions`: write the low ``nbytes`` of each gap, plane by plane."""
    count = positions.shape[0]
    for i in range(count):
        g = _gap(positions, i)
        for b in range(nbytes):
            planes[b * count + i] = (g >> (8 * b)) & 0xFF


@numba.njit(cache=True, nogil=True)
def gap_planes(positions):  # pragma: no cover
    """The gaps of sorted ``positions`` as byte planes, each as wide as the widest gap needs
    (at least one byte): (planes, bytes per gap)."""
    top = max_gap(positions)
    nbytes = (64 - leading_zeros(np.uint64(top)) + 7) // 8 if top > 0 else 1
    planes = np.empty(positions.shape[0] * nbytes, dtype=np.uint8)
    positions_to_gaps(positions, nbytes, planes)
    return planes, nbytes


@numba.njit(cache=True, nogil=True)
def split_planes(raw, itemsize, out):  # pragma: no cover
    """Little-endian element bytes ``raw`` (count * itemsize) to planes: byte b of every element."""
    count = raw.shape[0] // itemsize
    for i in range(count):
        for b in range(itemsize):
            out[b * count + i] = raw[i * itemsize + b]


@numba.njit(cache=True, nogil=True)
def join_planes(planes, itemsize, out):  # pragma: no cover
    count = planes.shape[0] // itemsize
    for i in range(count):
        for b in range(itemsize):
            out[i * itemsize + b] = planes[b * count + i]


@numba.njit(cache=True, nogil=True)
def scatter_many(table, like, positions, bits, sign):  # pragma: no cover
    """In place, for each tensor ``k`` at ``table[k]`` = (address of its elements, their count,
    its rule: 0 XOR, 1 add times ``sign``, wrapping like the integers of the bit patterns, and
    the span of ``positions`` and ``bits`` it owns: first, end), its bits at its positions;
    elements of ``like``'s type. Returns -1, or, with nothing written, the first ``k`` with a
    position outside its tensor. A library apply writes a decoded batch in one call: a call per
    tensor cost ~9 us of Python, more than most tensors take to write at 0.1% changed (65
    tensors of 25M: 0.93 against 0.37 ms)."""
    for k in range(table.shape[0]):
        n, bad = np.uint64(table[k, 1]), False
        for j in range(table[k, 3], table[k, 4]):
            bad |= np.uint64(positions[j]) >= n
        if bad:
            return k
    for k in range(table.shape[0]):
        target = numba.carray(address_as(table[k, 0], like), table[k, 1])
        if table[k, 2] == 0:
            for j in range(table[k, 3], table[k, 4]):
                target[positions[j]] ^= bits[j]
        else:
            for j in range(table[k, 3], table[k, 4]):
                target[positions[j]] += sign * bits[j]
    return -1


# --------------------------------------------------------------------------- entropy coding
# (see shared/entropy.py)
SMALL = 16
RICE_ESCAPE = 40


@numba.njit(cache=True, nogil=True, inline="always")
def _symbol(v):  # pragma: no cover
    """A value's symbol and how many raw bits follow it (see ``entropy``)."""
    v = np.uint64(v)
    if v < SMALL:
        return np.int64(v), 0
    b = 64 - leading_zeros(v)
    return SMALL + 2 * (b - 5) + np.int64((v >> np.uint64(b - 2)) & np.uint64(1)), b - 2


@numba.njit(cache=True, nogil=True)
def symbolize(x, sym, nraw, counts):  # pragma: no cover
    """Each value's symbol and raw-bit count; ``counts`` (zeroed) gets the symbols' histogram.
    Returns the total raw bits."""
    total = 0
    for i in range(x.shape[0]):
        s, n = _symbol(x[i])
        sym[i] = s
        nraw[i] = n
        total += n
        counts[s] += 1
    return total


@numba.njit(cache=True, nogil=True, inline="always")
def _ints_bytes(counts, n, raw_bits):  # pragma: no cover
    """Bytes ``entropy.encode_ints`` is estimated to take for ``n`` values, from their symbols'
    histogram and raw bits (no coding): the symbols' order-0 entropy, the raw bits, the blob's
    header and ~3 table bytes per used symbol."""
    bits = 0.0
    used = 0
    for c in counts:
        if c > 0:
            p = c / max(n, 1)
            bits -= p * np.log2(p)
            used += 1
    return (bits * n + raw_bits) / 8 + 12 + 3 * used


@numba.njit(cache=True, nogil=True)
def quantise_counts(counts, bits, freq):  # pragma: no cover
    """Frequencies for rANS into ``freq``: each used symbol's count scaled to ``2**bits`` and
    rounded half to even (at least 1); the first largest absorbs the rounding."""
    total = 1 << bits
    scale = total / counts.sum()
    used = 0
    best = 0
    for i in range(counts.shape[0]):
        f = 0
        if counts[i] > 0:
            f = max(1, np.int64(np.rint(counts[i] * scale)))
        freq[i] = f
        used += f
        if f > freq[best]:
            best = i
    freq[best] += total - used


_XLOGX = np.array([0.0] + [c * np.log2(c) for c in range(1, 4097)])  # a log2 per bin was most of the cost


@numba.njit(cache=True, nogil=True, inline="always")
def _planes_bits(counts, n):  # pragma: no cover
    """Order-0 entropy in bytes of each row of ``counts`` (histograms of ``n`` values each):
    ``n log2 n - sum(c log2 c)`` per row."""
    bits = 0.0
    for p in range(counts.shape[0]):
        bits += n * np.log2(max(n, 1))
        for c in counts[p]:
            bits -= _XLOGX[c] if c < _XLOGX.shape[0] else c * np.log2(c)
    return bits / 8


@numba.njit(cache=True, nogil=True)
def value_kind_sizes(xor, new, gate, alphabet, out):  # pragma: no cover
    """``codec.choose_mode``'s three figures in one pass: ``_ints_bytes`` of the XORs
    and of the zigzagged wrapping differences (the "add" kind), and the order-0 entropy in bytes
    of each byte plane of the first ``gate`` new values (roughly what zstd's literals cost when
    the planes hold no repeats), into ``out[0..2]``."""
    width = xor.itemsize
    mask = np.uint64((1 << (8 * width)) - 1)
    half, full = np.int64(1) << (8 * width - 1), np.int64(1) << (8 * width)
    cx, ca = np.zeros(alphabet, dtype=np.int64), np.zeros(alphabet, dtype=np.int64)
    planes = np.zeros((width, 256), dtype=np.int64)
    rx, ra = 0, 0
    for i in range(xor.shape[0]):
        x, v = np.uint64(xor[i]), np.uint64(new[i])
        s, r = _symbol(x)
        cx[s] += 1
        rx += r
        d = np.int64((v - (v ^ x)) & mask)  # new - old, wrapping in the element's width
        if d >= half:
            d -= full
        s, r = _symbol(np.uint64((d << 1) ^ (d >> 63)))
        ca[s] += 1
        ra += r
        if i < gate:
            for p in range(width):
                planes[p, (v >> np.uint64(8 * p)) & np.uint64(0xFF)] += 1
    out[0] = _ints_bytes(cx, xor.shape[0], rx)
    out[1] = _ints_bytes(ca, xor.shape[0], ra)
    out[2] = _planes_bits(planes, gate)


@numba.njit(cache=True, nogil=True)
def pack_bits(x, nraw, out):  # pragma: no cover
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
def _escaped_value(s, raw, bit, limit):  # pragma: no cover
    """The value of symbol ``s`` >= SMALL: its implied top bits over ``n`` low bits read from
    ``raw`` at ``bit``. Returns (value, next bit), or bit -1 if the raw bits run out."""
    n = (s - SMALL) // 2 + 3
    if bit + n > limit:
        return np.uint64(0), -1
    return ((np.uint64(2) | np.uint64((s - SMALL) & 1)) << np.uint64(n)) | read_bits(raw, bit, n), bit + n


@numba.njit(cache=True, nogil=True, inline="always")
def put_bits(out, n, acc, filled, bits, nbits):  # pragma: no cover
    """Append ``nbits`` (<= 64) low bits of ``bits``; returns the writer's new state. ``acc``
    holds ``filled`` (< 64) bits and is written out 8 bytes at a time when full: a loop over
    bytes per code cost a mispredicted branch or two each (Rice codes 8.0 -> 6.4 ns a gap)."""
    if nbits == 0:
        return n, acc, filled
    acc |= bits << np.uint64(filled)
    if filled + nbits < 64:
        return n, acc, filled + nbits
    for j in range(8):
        out[n + j] = (acc >> np.uint64(8 * j)) & np.uint64(0xFF)
    spill = filled + nbits - 64  # bits of ``bits`` left over: spill > 0 needs filled > 0, so the shift is < 64
    return n + 8, (bits >> np.uint64(nbits - spill)) if spill > 0 else np.uint64(0), spill


@numba.njit(cache=True, nogil=True, inline="always")
def put_last(out, n, acc, filled):  # pragma: no cover
    """The bytes :func:`put_bits` still holds, written out; returns the bytes written in all."""
    while filled > 0:
        out[n] = acc & np.uint64(0xFF)
        n += 1
        acc >>= np.uint64(8)
        filled -= 8
    return n


@numba.njit(cache=True, nogil=True, inline="always")
def _value(x, i, running):  # pragma: no cover
    """``x[i]``, or with ``running`` the gap before position ``x[i]`` (the first from -1). Two
    returns, not one conditional expression: numba unifies int64 and uint64 as float64, which
    rounded values above 2**53."""
    if running:
        return np.uint64(_gap(x, i))
    return np.uint64(x[i])


@numba.njit(cache=True, nogil=True)
def rice_bits(x, k, running):  # pragma: no cover
    """Bits of the Rice code of ``x`` (gaps of positions with ``running``) and its escapes."""
    bits, escapes = 0, 0
    for i in range(x.shape[0]):
        q = _value(x, i, running) >> np.uint64(k)
        if q >= RICE_ESCAPE:
            bits += RICE_ESCAPE + 1 + k
            escapes += 1
        else:
            bits += np.int64(q) + 1 + k
    return bits, escapes


@numba.njit(cache=True, nogil=True)
def rice_pack(x, k, out, running):  # pragma: no cover
    """Rice code of ``x``, or with ``running`` of the gaps of the positions ``x``."""
    n, acc, filled = 0, np.uint64(0), 0
    mask = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
    for i in range(x.shape[0]):
        v = _value(x, i, running)
        q = v >> np.uint64(k)
        if q >= RICE_ESCAPE:  # the escape run of ones, a zero, then all 64 bits
            n, acc, filled = put_bits(out, n, acc, filled, np.uint64((1 << RICE_ESCAPE) - 1), RICE_ESCAPE + 1)
            n, acc, filled = put_bits(out, n, acc, filled, v & np.uint64(0xFFFFFFFF), 32)
            n, acc, filled = put_bits(out, n, acc, filled, v >> np.uint64(32), 32)
        elif int(q) + 1 + k <= 56:  # the unary part and the remainder in one write
            n, acc, filled = put_bits(out, n, acc, filled, ((np.uint64(1) << q) - np.uint64(1)) |
                                      ((v & mask) << (q + np.uint64(1))), int(q) + 1 + k)
        else:
            n, acc, filled = put_bits(out, n, acc, filled, (np.uint64(1) << q) - np.uint64(1), int(q) + 1)
            n, acc, filled = put_bits(out, n, acc, filled, v & mask, k)
    return put_last(out, n, acc, filled)


@numba.njit(cache=True, nogil=True)
def rice_code(x, k_lo, k_hi, running):  # pragma: no cover
    """The smallest Rice code of ``x`` over ``k_lo <= k < k_hi`` (ties: fewer escapes, then the
    smaller k): (k, code bytes)."""
    best_bits, best_escapes, best_k = -1, 0, k_lo
    for k in range(k_lo, k_hi):
        bits, escapes = rice_bits(x, k, running)
        if best_bits < 0 or (bits, escapes) < (best_bits, best_escapes):
            best_bits, best_escapes, best_k = bits, escapes, k
    out = np.zeros(best_bits // 8 + 9 * best_escapes + 2, dtype=np.uint8)
    return best_k, out[:rice_pack(x, best_k, out, running)]


@numba.njit(cache=True, nogil=True)
def rice_auto(x, running):  # pragma: no cover
    """:func:`rice_code` over the three parameters around ``floor(log2(0.69 * mean))``, the
    one a geometric distribution of this mean wants (the mean of the gaps with ``running``)."""
    n = x.shape[0]
    mean = 0.0
    if n and running:  # the gaps add up to the last position + 1 - n
        mean = (x[n - 1] + 1 - n) / n
    elif n:
        for i in range(n):
            mean += np.float64(x[i])
        mean /= n
    k0 = 63 - leading_zeros(np.uint64(max(mean * 0.69, 1.0)))  # floor(log2), exact
    return rice_code(x, min(max(0, k0 - 1), 56), min(57, k0 + 2), running)


@numba.njit(cache=True, nogil=True)
def read_bits(buf, bit, n):  # pragma: no cover
    v = np.uint64(0)
    got = 0
    while got < n:
        byte = np.uint64(buf[bit >> 3]) >> np.uint64(bit & 7)
        take = min(8 - (bit & 7), n - got)
        v |= (byte & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))) << np.uint64(got)
        got += take
        bit += take
    return v


@numba.njit(cache=True, nogil=True, inline="always")
def _refill(buf, acc, avail, pos, upto):  # pragma: no cover
    """Bytes of ``buf`` from ``pos`` into the reservoir ``acc`` above its ``avail`` bits until it
    holds more than ``upto`` (zero bits past the end of ``buf``, counted)."""
    while avail <= upto:
        if pos < buf.shape[0]:
            acc |= np.uint64(buf[pos]) << np.uint64(avail)
        pos += 1
        avail += 8
    return acc, avail, pos


@numba.njit(cache=True, nogil=True, inline="always")
def _rice_value(buf, k, mask, acc, avail, pos):  # pragma: no cover
    """The next value of a Rice code with parameter ``k`` (``mask``: its low ``k`` bits) from
    the reservoir ``acc`` of ``avail`` bits, refilled from byte ``pos`` of ``buf``. Returns
    (value, acc, avail, pos, ok); not ok for a unary run longer than RICE_ESCAPE (damaged)."""
    acc, avail, pos = _refill(buf, acc, avail, pos, 56)
    q = np.int64(trailing_zeros(~acc)) if ~acc != np.uint64(0) else np.int64(64)
    if q > RICE_ESCAPE:
        return np.uint64(0), acc, avail, pos, False
    acc >>= np.uint64(q + 1)
    avail -= q + 1
    if q == RICE_ESCAPE:  # then the value's 64 bits, in two halves
        v = np.uint64(0)
        for half in range(2):
            acc, avail, pos = _refill(buf, acc, avail, pos, 56)
            v |= (acc & np.uint64(0xFFFFFFFF)) << np.uint64(32 * half)
            acc >>= np.uint64(32)
            avail -= 32
        return v, acc, avail, pos, True
    acc, avail, pos = _refill(buf, acc, avail, pos, k - 1)  # usually still there: the reservoir held 57 bits or more
    v = (np.uint64(q) << np.uint64(k)) | (acc & mask)
    return v, acc >> np.uint64(k), avail - k, pos, True


@numba.njit(cache=True, nogil=True, inline="always")
def _next_position(prev, gap, limit):  # pragma: no cover
    """``prev + gap + 1`` and whether it is below ``limit`` (tested without overflow)."""
    if gap >= np.uint64(limit - prev - 1):
        return prev, False
    return prev + np.int64(gap) + 1, True


@numba.njit(cache=True, nogil=True)
def rice_unpack(buf, k, count, out, running, limit):  # pragma: no cover
    """Decode ``count`` values into ``out``, or with ``running`` the positions they are the gaps
    of (``out[i] = out[i-1] + v + 1``, from -1). Returns the bytes consumed, -1 if the input
    runs out, or -2 if a running position reaches ``limit`` (damaged): the positions it writes
    are strictly increasing and below ``limit`` (at most 2**62), so callers need no second pass
    to check them.

    A 64-bit reservoir is refilled a byte at a time to hold at least 57 bits, so a unary run
    (at most RICE_ESCAPE ones) and a remainder of up to 56 bits are always in it.
    """
    if k > 56:
        return -1
    acc = np.uint64(0)
    avail = 0  # valid bits in acc, counting zero bits past the end of buf
    pos = 0  # next byte of buf
    mask = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
    prev = np.int64(-1)
    for i in range(count):
        v, acc, avail, pos, ok = _rice_value(buf, k, mask, acc, avail, pos)
        if not ok:
            return -1
        if running:
            prev, ok = _next_position(prev, v, limit)
            if not ok:
                return -2
            out[i] = prev
        else:
            out[i] = v
    used = pos * 8 - avail  # bits actually consumed
    return (used + 7) // 8 if used <= buf.shape[0] * 8 else -1


# --------------------------------------------------------------------------- rANS
# Byte-wise rANS with a 32-bit state (after Duda; the layout of ryg_rans), static frequencies
# quantised to PROB_BITS. Encoding runs backwards so that decoding runs forwards.
PROB_BITS = 12
RANS_L = 1 << 23


@numba.njit(cache=True, nogil=True)
def rans_encode(sym, freq, cum, out):  # pragma: no cover
    """Encode ``sym`` into the tail of ``out``; returns the start index of the code in ``out``.

    ``x // f`` by a multiply and a shift (a 64-bit division per symbol cost ~20% more): with
    ``l = ceil(log2 f)`` and ``m = floor(2**(31 + l) / f) + 1``, ``(x * m) >> (31 + l)`` is
    ``x // f`` for every ``x < 2**31`` (Granlund and Montgomery), and the state stays below
    ``2**31`` after renormalising, so the product fits in 64 bits."""
    mul = np.zeros(freq.shape[0], dtype=np.uint64)
    shift = np.zeros(freq.shape[0], dtype=np.uint64)
    for s in range(freq.shape[0]):
        f = np.int64(freq[s])
        if f > 0:
            l = 0
            while (np.int64(1) << l) < f:
                l += 1
            mul[s] = np.uint64((np.int64(1) << (31 + l)) // f + 1)
            shift[s] = np.uint64(31 + l)
    x = np.uint64(RANS_L)
    ptr = out.shape[0]
    for i in range(sym.shape[0] - 1, -1, -1):
        s = sym[i]
        f = np.uint64(freq[s])
        x_max = np.uint64(((RANS_L >> PROB_BITS) << 8)) * f
        while x >= x_max:
            ptr -= 1
            out[ptr] = x & np.uint64(0xFF)
            x >>= np.uint64(8)
        q = (x * mul[s]) >> shift[s]
        x = (q << np.uint64(PROB_BITS)) + (x - q * f) + np.uint64(cum[s])
    for _ in range(4):
        ptr -= 1
        out[ptr] = x & np.uint64(0xFF)
        x >>= np.uint64(8)
    return ptr


@numba.njit(cache=True, nogil=True, inline="always")
def _put_gamma(out, n, acc, filled, v):  # pragma: no cover
    """The Elias-gamma code of ``v`` (1 <= v < 2**31), least significant bit first: as many ones
    as ``v`` has bits after its leading one, a zero, then those bits."""
    q = 63 - leading_zeros(np.uint64(v))
    ones = (np.uint64(1) << np.uint64(q)) - np.uint64(1)
    return put_bits(out, n, acc, filled, ones | ((np.uint64(v) & ones) << np.uint64(q + 1)), 2 * q + 1)


@numba.njit(cache=True, nogil=True)
def table_code(freq):  # pragma: no cover
    """An entropy-coded blob's table section (format 4): the count of used symbols plus one,
    then per used symbol, in order, its distance from the one before (the first from -1) and its
    frequency, all in Elias-gamma codes: 2-5 bytes a used symbol, ~9 bytes for one-ulp steps,
    where a zstd frame of the whole table took ~25 bytes, ~6 us to make and a call to read."""
    out = np.zeros(8 * freq.shape[0] + 16, dtype=np.uint8)  # 5 bytes a symbol at most
    used = 0
    for s in range(freq.shape[0]):
        used += freq[s] > 0
    n, acc, filled = _put_gamma(out, 0, np.uint64(0), 0, used + 1)
    prev = -1
    for s in range(freq.shape[0]):
        if freq[s] > 0:
            n, acc, filled = _put_gamma(out, n, acc, filled, s - prev)
            n, acc, filled = _put_gamma(out, n, acc, filled, freq[s])
            prev = s
    return out[:put_last(out, n, acc, filled)]


@numba.njit(cache=True, nogil=True, inline="always")
def _gamma_value(buf, acc, avail, pos):  # pragma: no cover
    """The next Elias-gamma value (see :func:`_put_gamma`) from the reservoir ``acc`` of
    ``avail`` bits, refilled from byte ``pos`` of ``buf``: (value, acc, avail, pos, ok); not
    ok for a value of 2**31 or more (damaged)."""
    acc, avail, pos = _refill(buf, acc, avail, pos, 56)
    q = np.int64(trailing_zeros(~acc)) if ~acc != np.uint64(0) else np.int64(64)
    if q > 30:
        return np.uint64(0), acc, avail, pos, False
    acc >>= np.uint64(q + 1)
    avail -= q + 1
    acc, avail, pos = _refill(buf, acc, avail, pos, 56)
    v = (np.uint64(1) << np.uint64(q)) | (acc & ((np.uint64(1) << np.uint64(q)) - np.uint64(1)))
    return v, acc >> np.uint64(q), avail - q, pos, True


@numba.njit(cache=True, nogil=True)
def table_decode(buf, out):  # pragma: no cover
    """:func:`table_code`'s inverse into ``out`` (zeroed here). False for a damaged table: a
    code running past ``buf`` or ending a byte or more before its end, a symbol past ``out``, a
    frequency above ``2**PROB_BITS`` (that they add up is checked where they are used)."""
    out[:] = 0
    acc, avail, pos = np.uint64(0), 0, 0
    v, acc, avail, pos, ok = _gamma_value(buf, acc, avail, pos)
    if not ok or v - np.uint64(1) > np.uint64(out.shape[0]):
        return False
    s = np.int64(-1)
    for _ in range(np.int64(v) - 1):
        gap, acc, avail, pos, ok = _gamma_value(buf, acc, avail, pos)
        if not ok or gap >= np.uint64(out.shape[0] - s):
            return False
        s += np.int64(gap)
        f, acc, avail, pos, ok = _gamma_value(buf, acc, avail, pos)
        if not ok or f > np.uint64(1 << PROB_BITS):
            return False
        out[s] = f
    return (pos * 8 - avail + 7) // 8 == buf.shape[0]


@numba.njit(cache=True, nogil=True)
def table_decode_many(buf, lo, hi, tables):  # pragma: no cover
    """:func:`table_decode` of the sections ``buf[lo[t]:hi[t]]`` into the rows of ``tables``:
    -1, or the first damaged one."""
    for t in range(lo.shape[0]):
        if not table_decode(buf[lo[t]:hi[t]], tables[t]):
            return t
    return -1


@numba.njit(cache=True, nogil=True, inline="always")
def _put_u32(out, at, v):  # pragma: no cover
    for j in range(4):
        out[at + j] = (np.uint64(v) >> np.uint64(8 * j)) & np.uint64(0xFF)


@numba.njit(cache=True, nogil=True)
def encode_ints_blob(bits, zig, alphabet):  # pragma: no cover
    """``entropy.encode_ints``' blob in one call: (blob, ok); not ok when the counts cannot be
    quantised."""
    n = bits.shape[0]
    x = np.empty(n, dtype=np.uint64)
    width = 8 * bits.itemsize
    for i in range(n):
        v = np.uint64(bits[i])
        if zig:  # sign-extend from the element's width, then zigzag
            s = np.int64(v << np.uint64(64 - width)) >> (64 - width)
            v = np.uint64((s << 1) ^ (s >> 63))
        x[i] = v
    sym = np.empty(n, dtype=np.int32)
    nraw = np.empty(n, dtype=np.uint8)
    counts = np.zeros(alphabet, dtype=np.int64)
    total = symbolize(x, sym, nraw, counts)
    freq = np.zeros(alphabet, dtype=np.int64)
    code = np.empty(n * 4 + 16, dtype=np.uint8)  # worst case: 32 bits a symbol
    start = code.shape[0]
    if n:
        quantise_counts(counts, PROB_BITS, freq)
        if freq.min() < 0 or freq.max() > 1 << PROB_BITS:
            return np.empty(0, dtype=np.uint8), False
        start = rans_encode(sym, freq, np.cumsum(freq) - freq, code)
    table = table_code(freq)
    nt, nc, nr = table.shape[0], code.shape[0] - start, (total + 7) // 8
    blob = np.zeros(12 + nt + nc + nr, dtype=np.uint8)
    _put_u32(blob, 0, nt)
    _put_u32(blob, 4, nc)
    _put_u32(blob, 8, nr)
    blob[12:12 + nt] = table
    blob[12 + nt:12 + nt + nc] = code[start:]
    pack_bits(x, nraw, blob[12 + nt + nc:])
    return blob, True


@numba.njit(cache=True, nogil=True)
def _put(buf, used, data):  # pragma: no cover
    """``data`` appended to ``buf[:used]``, growing it by doubling: (buffer, bytes used)."""
    need = used + data.shape[0]
    if need > buf.shape[0]:
        bigger = np.empty(max(need, 2 * buf.shape[0]), dtype=np.uint8)
        bigger[:used] = buf[:used]
        buf = bigger
    buf[used:need] = data
    return buf, need


@numba.njit(cache=True, nogil=True)
def _add_bits(xor, new):  # pragma: no cover
    """``codec.value_bits`` of "add": new - old, wrapping in the element's width."""
    bits = np.empty_like(xor)
    for i in range(xor.shape[0]):
        v = np.uint64(new[i])
        bits[i] = v - (v ^ np.uint64(xor[i]))
    return bits


# encode_sparse_many's per-tensor row of ``spans``, and what a tensor still needs from its caller
SPAN_NEEDS, SPAN_MODE, SPAN_VAL, SPAN_POS, SPAN_END = range(5)
NEEDS_SET_TRIAL, NEEDS_POSITIONS_TRIAL, NEEDS_ALL = 1, 2, 4


@numba.njit(cache=True, nogil=True)
def encode_sparse_many(starts, positions, xor, new, sample, gate, pattern, alphabet, spans,
                       estimates):  # pragma: no cover
    """``codec.encode_changes`` of many tensors in one call (per tensor, the calls cost ~100 us of
    dispatch and numpy: most of what a tensor with few changes took). Tensor ``t`` is changes
    ``starts[t]:starts[t+1]`` of the sorted ``positions``, their ``xor`` and ``new`` bits.

    Per tensor: the value kind ("xor" 0 or "add" 1) estimated smaller on the first ``sample``
    changes by :func:`value_kind_sizes` (its estimates into ``estimates[t]``), the values' blob
    (:func:`encode_ints_blob`) and the positions' (the Rice parameter's byte, then the code),
    appended to the returned buffer, which they tile tensor by tensor; ``spans[t]`` (``SPAN_*``)
    says where. The zstd trials are left to the caller, flagged in ``spans[t, SPAN_NEEDS]``:
    ``NEEDS_SET_TRIAL`` where the "set" kind may beat the estimates (no values coded),
    ``NEEDS_POSITIONS_TRIAL`` where :func:`zstd_may_win` against the Rice code, ``NEEDS_ALL``
    where the counts could not be quantised (nothing kept)."""
    buf = np.empty(1 << 16, dtype=np.uint8)
    used = 0
    sizes = np.empty(3)
    k_byte = np.empty(1, dtype=np.uint8)
    for t in range(starts.shape[0] - 1):
        a, b = starts[t], starts[t + 1]
        k = min(sample, b - a)
        g = min(gate, k)
        spans[t, :] = used
        spans[t, SPAN_NEEDS], spans[t, SPAN_MODE] = 0, 0
        if k == 0:
            spans[t, SPAN_NEEDS] = NEEDS_ALL
            continue
        value_kind_sizes(xor[a:a + k], new[a:a + k], g, alphabet, sizes)
        estimates[t, 0], estimates[t, 1] = sizes[0], sizes[1]
        add = sizes[1] < sizes[0]  # ties go to "xor"
        spans[t, SPAN_MODE] = np.int64(add)
        if sizes[2] * k / g < 2 * min(sizes[0], sizes[1]):
            spans[t, SPAN_NEEDS] = NEEDS_SET_TRIAL  # "set" usually wins then: no values coded here
        else:
            bits = _add_bits(xor[a:b], new[a:b]) if add else xor[a:b]
            blob, ok = encode_ints_blob(bits, add, alphabet)
            if not ok:
                spans[t, SPAN_NEEDS] = NEEDS_ALL
                continue
            buf, used = _put(buf, used, blob)
        spans[t, SPAN_POS] = used
        k_byte[0], rice = rice_auto(positions[a:b], True)
        if zstd_may_win(positions[a:b], rice.shape[0] + 1, pattern):  # + the byte of k
            spans[t, SPAN_NEEDS] |= NEEDS_POSITIONS_TRIAL
        buf, used = _put(buf, used, k_byte)
        buf, used = _put(buf, used, rice)
        spans[t, SPAN_END] = used
    return buf[:used]


@numba.njit(cache=True, nogil=True, inline="always")
def _rans_slots(table, slots):  # pragma: no cover
    """The slot table of the symbol frequencies ``table`` into ``slots``, one load per slot:
    the symbol (bits 32-47), its frequency (bits 0-15) and the slot's offset within the
    symbol's range (bits 16-31), which the state update needs. False if the frequencies do not
    add up to ``2**PROB_BITS`` (damaged input)."""
    total = 0
    for s in range(table.shape[0]):
        total += np.int64(table[s])
    if total != 1 << PROB_BITS:
        return False
    at = 0
    for s in range(table.shape[0]):
        f = np.uint64(table[s])
        for j in range(np.int64(table[s])):
            slots[at + j] = (np.uint64(s) << np.uint64(32)) | (np.uint64(j) << np.uint64(16)) | f
        at += np.int64(table[s])
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _rans_start(code):  # pragma: no cover
    """The decoder's state from the code's first 4 bytes (the caller checks there are 4)."""
    x = np.uint64(0)
    for j in range(4):
        x = (x << np.uint64(8)) | np.uint64(code[j])
    return x


@numba.njit(cache=True, nogil=True, inline="always")
def _rans_value(code, raw, slots, x, ptr, bit, zig):  # pragma: no cover
    """The next value: a symbol from the state ``x`` (renormalised from byte ``ptr`` of
    ``code``), its raw bits from bit ``bit`` of ``raw`` where it has some, unzigzagged with
    ``zig`` (the value's bits, as uint64). Returns (value, x, ptr, bit, ok); not ok when the
    code or the raw bits run out."""
    packed = slots[x & np.uint64((1 << PROB_BITS) - 1)]
    s = np.int64(packed >> np.uint64(32))
    x = (packed & np.uint64(0xFFFF)) * (x >> np.uint64(PROB_BITS)) + ((packed >> np.uint64(16)) & np.uint64(0xFFFF))
    while x < np.uint64(RANS_L):
        if ptr >= code.shape[0]:
            return np.uint64(0), x, ptr, bit, False
        x = (x << np.uint64(8)) | np.uint64(code[ptr])
        ptr += 1
    if s < SMALL:
        v = np.uint64(s)
    else:
        v, bit = _escaped_value(s, raw, bit, raw.shape[0] * 8)
        if bit < 0:
            return np.uint64(0), x, ptr, bit, False
    if zig:
        v = np.uint64(np.int64(v >> np.uint64(1)) ^ -np.int64(v & np.uint64(1)))
    return v, x, ptr, bit, True


@numba.njit(cache=True, nogil=True, inline="always")
def _too_wide(v, zig, width):  # pragma: no cover
    """Whether a decoded value does not fit its ``width``-bit element (a zigzagged one always
    does: its bits are the element's, wrapped)."""
    return not zig and width < 64 and (v >> np.uint64(width)) != 0


@numba.njit(cache=True, nogil=True)
def rans_decode_values(code, table, raw, zig, width, out, slots):  # pragma: no cover
    """Decode rANS symbols and their raw bits (and, with ``zig``, unzigzag them) in one pass,
    straight into the element-wide unsigned ``out``: no symbol or 64-bit arrays in between.
    ``table``: the symbols' frequencies (uint16), from which the slot table is built here, into
    ``slots`` (``2**PROB_BITS`` uint64, scratch: one buffer serves many tensors), as a small
    array pass is cheaper in numba than its numpy calls. Returns 0, -1
    if the code or the raw bits run out, -2 if a value is wider than ``width`` bits, -3 if the
    frequencies do not add up (damaged input)."""
    count = out.shape[0]
    if count == 0:
        return 0
    if not _rans_slots(table, slots):
        return -3
    if code.shape[0] < 4:
        return -1
    x, ptr, bit = _rans_start(code), 4, 0
    for i in range(count):
        v, x, ptr, bit, ok = _rans_value(code, raw, slots, x, ptr, bit, zig)
        if not ok:
            return -1
        if _too_wide(v, zig, width):
            return -2
        out[i] = v
    return 0


# decode_sparse's failure codes, named in shared/codec.py
RICE_K, RICE_SHORT, RICE_OUTSIDE, ANS_SHORT, ANS_WIDE, ANS_TABLE = 1, 2, 3, 4, 5, 6


@numba.njit(cache=True, nogil=True)
def _decode_pairs(pbuf, k, limit, code, raw, slots, zig, width, positions, values):  # pragma: no cover
    """:func:`decode_sparse`'s loop for one tensor: its values (rANS under ``slots``) and positions
    (Rice-coded gaps) a pair per step. Returns 0 or a failure code."""
    if code.shape[0] < 4:
        return ANS_SHORT
    x, ptr, bit = _rans_start(code), 4, 0
    acc, avail, pos = np.uint64(0), 0, 0
    mask = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
    prev = np.int64(-1)
    for i in range(positions.shape[0]):
        v, x, ptr, bit, ok = _rans_value(code, raw, slots, x, ptr, bit, zig)
        if not ok:
            return ANS_SHORT
        if _too_wide(v, zig, width):
            return ANS_WIDE
        values[i] = v
        gap, acc, avail, pos, ok = _rice_value(pbuf, k, mask, acc, avail, pos)
        if not ok:
            return RICE_SHORT
        prev, ok = _next_position(prev, gap, limit)
        if not ok:
            return RICE_OUTSIDE
        positions[i] = prev
    return RICE_SHORT if pos * 8 - avail > pbuf.shape[0] * 8 else 0


@numba.njit(cache=True, nogil=True)
def decode_sparse(buf, pos_lo, pos_hi, code_at, raw_at, val_hi, tables, counts, limits, zig, width,
                  positions, values):  # pragma: no cover
    """Several tensors' Rice-coded positions and rANS-coded values in one call (a call per blob
    costs tens of microseconds in Python). Tensor ``t``: its position blob is
    ``buf[pos_lo[t]:pos_hi[t]]`` (the Rice parameter, then the code); its value blob's rANS code
    is ``buf[code_at[t]:raw_at[t]]`` and its raw bits ``buf[raw_at[t]:val_hi[t]]``, under the
    symbol frequencies ``tables[t]`` (``code_at[t] < 0``: its values are in place already, coded
    otherwise). Its ``counts[t]`` positions (checked strictly increasing and below ``limits[t]``)
    and values go to the next ``counts[t]`` slots of ``positions`` and ``values``. Returns
    (-1, 0), or the first failing tensor and a code.

    A tensor's positions and values are decoded in one loop, a value and a position per step:
    each decoder is a chain of dependent steps, and interleaved the CPU runs the two chains side
    by side (the kernel 12-23% faster than a loop each, 26M elements at 0.1-5% changed, one
    thread)."""
    at = 0
    slots = np.empty(1 << PROB_BITS, dtype=np.uint64)  # one slot table, rebuilt per tensor
    for t in range(counts.shape[0]):
        n = counts[t]
        p0, p1 = pos_lo[t], pos_hi[t]
        if p1 - p0 < 1 or buf[p0] > 56:
            return t, RICE_K
        pbuf, k, limit = buf[p0 + 1:p1], np.int64(buf[p0]), min(limits[t], np.int64(1) << 62)
        if not n or code_at[t] < 0:
            got = rice_unpack(pbuf, k, n, positions[at:at + n], True, limit)
            if got == -2:
                return t, RICE_OUTSIDE
            if got < 0:
                return t, RICE_SHORT
            at += n
            continue
        if not _rans_slots(tables[t], slots):
            return t, ANS_TABLE
        got = _decode_pairs(pbuf, k, limit, buf[code_at[t]:raw_at[t]], buf[raw_at[t]:val_hi[t]], slots, zig[t],
                            width, positions[at:at + n], values[at:at + n])
        if got:
            return t, got
        at += n
    return -1, 0


# --------------------------------------------------------------------------- classed positions
# Whether an element changes depends strongly on its base exponent (a small weight has a small
# ulp), so positions are coded per exponent class, as gaps between class-local indices.


@numba.njit(cache=True, nogil=True)
def class_local_indices(base, shift, mask, positions, cls, local):  # pragma: no cover
    """For each changed position: its class (``(base >> shift) & mask``) and its index among the
    elements of that class. Returns the per-class element counts."""
    counts = np.zeros(256, dtype=np.int64)
    j = 0
    n_pos = positions.shape[0]
    nxt = positions[0] if n_pos else -1
    for i in range(base.shape[0]):
        c = (np.int64(base[i]) >> shift) & mask
        if i == nxt:
            cls[j] = c
            local[j] = counts[c]
            j += 1
            nxt = positions[j] if j < n_pos else -1
        counts[c] += 1
    return counts


@numba.njit(cache=True, nogil=True)
def positions_from_classes(base, shift, mask, local, starts, ends, out):  # pragma: no cover
    """Inverse of :func:`class_local_indices`: ``local[starts[c]:ends[c]]`` are the sorted local
    indices of class c. Writes global positions in order; returns how many (less than
    ``out.shape[0]`` if the input was damaged)."""
    counts = np.zeros(256, dtype=np.int64)
    ptr = starts.copy()
    k = 0
    for i in range(base.shape[0]):
        c = (np.int64(base[i]) >> shift) & mask
        p = ptr[c]
        if p < ends[c] and local[p] == counts[c]:
            if k < out.shape[0]:
                out[k] = i
            k += 1
            ptr[c] = p + 1
        counts[c] += 1
    return k
