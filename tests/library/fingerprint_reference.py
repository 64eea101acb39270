"""Slow reference of the linear tensor fingerprint, in Python ints, written from DESIGN.md alone.

It shares no code with ``shared.fingerprint`` (only the definition), so the two can disagree.
64-bit elements follow the extension documented in ``shared/fingerprint.py``: their two
little-endian 32-bit halves are words 2i and 2i+1 of width 32.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)


def mix(z: int) -> int:
    """splitmix64's finalizer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def words(t: torch.Tensor) -> tuple[list[int], int]:
    """The unsigned words of ``t`` in C order, read from its raw little-endian bytes, and their width."""
    size = min(t.element_size(), 4)
    if t.numel() == 0:  # an empty view may have stride 0, which .view() of another width refuses
        return [], 8 * size
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [int.from_bytes(raw[j:j + size], "little") for j in range(0, len(raw), size)], 8 * size


def lanes_at(indices: list[int], bits: list[int], width: int) -> list[int]:
    """Lane sums of words ``bits`` at word indices ``indices``."""
    out = [0, 0, 0, 0]
    for i, b in zip(indices, bits, strict=True):
        x = ((i << width) + b) & MASK64
        for k in range(4):
            out[k] = (out[k] + mix(x ^ K[k])) & MASK64
    return out


def fingerprint_lanes(t: torch.Tensor, start: int = 0) -> list[int]:
    """Lanes of ``t`` whose first element has global flat index ``start``."""
    w, width = words(t)
    per = 2 if t.element_size() == 8 else 1
    return lanes_at(list(range(start * per, start * per + len(w))), w, width)


def fingerprint_hex(t: torch.Tensor, start: int = 0) -> str:
    return "".join(f"{v:016x}" for v in fingerprint_lanes(t, start))
