"""Numba kernels for the hot loops: one pass each, GIL released so callers can use threads.

Kept tiny and free of policy: they see flat integer arrays only.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def scan_changes(old_w, new_w, old_e, new_e, lanes, out_pos, out_xor, offset):  # pragma: no cover
    """Compare 64-bit words, then lanes of changed words; record positions (``offset`` added) and
    XORs. Returns the number of changed elements, which may exceed the outputs' capacity."""
    cap = out_pos.shape[0]
    k = 0
    for w in range(old_w.shape[0]):
        if old_w[w] != new_w[w]:
            base = w * lanes
            for j in range(lanes):
                x = old_e[base + j] ^ new_e[base + j]
                if x != 0:
                    if k < cap:
                        out_pos[k] = offset + base + j
                        out_xor[k] = x
                    k += 1
    for i in range(old_w.shape[0] * lanes, old_e.shape[0]):
        x = old_e[i] ^ new_e[i]
        if x != 0:
            if k < cap:
                out_pos[k] = offset + i
                out_xor[k] = x
            k += 1
    return k


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


@numba.njit(cache=True, nogil=True)
def xor_scatter(target, positions, bits):  # pragma: no cover
    """``target[positions] ^= bits`` in one read-modify-write pass (its own inverse)."""
    for i in range(positions.shape[0]):
        target[positions[i]] ^= bits[i]


@numba.njit(cache=True, nogil=True)
def max_gap(positions):  # pragma: no cover
    top, prev = 0, -1
    for i in range(positions.shape[0]):
        g = positions[i] - prev - 1
        if g > top:
            top = g
        prev = positions[i]
    return top


@numba.njit(cache=True, nogil=True)
def positions_to_gaps(positions, nbytes, planes):  # pragma: no cover
    """Inverse of :func:`gaps_to_positions`: write the low ``nbytes`` of each gap, plane by plane."""
    count = positions.shape[0]
    prev = -1
    for i in range(count):
        g = positions[i] - prev - 1
        prev = positions[i]
        for b in range(nbytes):
            planes[b * count + i] = (g >> (8 * b)) & 0xFF


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
def add_scatter(target, positions, bits, sign):  # pragma: no cover
    """``target[positions] += sign * bits``, wrapping like the integers of the bit patterns."""
    for i in range(positions.shape[0]):
        target[positions[i]] += sign * bits[i]
