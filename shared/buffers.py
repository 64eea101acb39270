"""Large working arrays kept between versions, so that decoding one does not fault in fresh pages.

A process that applies version after version (a replica) decodes
several bytes per changed element into new arrays every time. Up to 32 MiB glibc's malloc keeps
freed blocks and hands them out again; a larger ``np.empty`` is a fresh ``mmap``, and the kernel
zeroes every page of it on first touch. On a virtual machine whose host takes back freed guest
pages (a balloon's free page reporting, as on the machine these figures come from) that first
touch faults on the host too: decoding 11.5M changes of a 202M model took 55-60 ms of CPU a thread
when its pages were backed and 145-210 ms when they were not, 100-290 ms a version in the kernel's
``clear_page``.

:func:`empty` hands out a view of a kept buffer that nothing else refers to any more. Its lifetime
needs no bookkeeping by the caller: a numpy view, a view of it or a ``torch.from_numpy`` tensor of
either keeps the buffer's reference count up, so a buffer is reused only once every array and
tensor made from it is gone (CPython's reference counts).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

KEEP_FROM = 1 << 20  # bytes: below, a fresh block is a few pages (malloc keeps blocks up to 32 MiB, but a thread's arena returns them)
KEEP = 32  # buffers kept at most: two versions alive at once, a few arrays a thread each

_lock = threading.Lock()
_kept: list[np.ndarray] = []  # uint8 owners


def _free(i: int) -> bool:
    return sys.getrefcount(_kept[i]) == 2  # the list's reference and the call's argument


def empty(n: int, dtype: np.dtype | type) -> np.ndarray:
    """``np.empty(n, dtype)``, in a kept buffer where it is large enough to be worth keeping.

    Best fit among the free buffers; else a new one, kept in place of the smallest free one once
    :data:`KEEP` are kept (not kept at all when every kept one is in use)."""
    dtype = np.dtype(dtype)
    size = n * dtype.itemsize
    if size < KEEP_FROM:
        return np.empty(n, dtype)
    with _lock:
        free = [i for i in range(len(_kept)) if _free(i)]
        fits = [i for i in free if _kept[i].nbytes >= size]
        if fits:
            return _kept[min(fits, key=lambda i: _kept[i].nbytes)][:size].view(dtype)
        owner = np.empty(size + size // 4, np.uint8)  # room for the next version's batch to be larger
        if len(_kept) < KEEP:
            _kept.append(owner)
        elif free:
            _kept[min(free, key=lambda i: _kept[i].nbytes)] = owner
        return owner[:size].view(dtype)


def kept_bytes() -> int:
    """Bytes held by kept buffers, in use or not."""
    with _lock:
        return sum(b.nbytes for b in _kept)
