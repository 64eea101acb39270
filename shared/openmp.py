"""torch's OpenMP workers and the publisher's scan on the same cores.

After each parallel op, the workers of torch's OpenMP runtime (libgomp on Linux) spin for a while
before they sleep: by default 300000 ``pause`` loops, about 10 ms here (a ``publish()`` after a
10 ms sleep was nearly as fast as one with the spin bounded). A CPU trainer calls
``DeltaPublisher.publish()`` right after ``optimizer.step()``, so its scan threads share the cores
with those spinning workers for most of their run. On 2 cores, 26M bf16 parameters at ~1%
changed, ``publish()`` took 12.9-16.6 ms with libgomp's default and 8.1-11.7 ms with 10000 spins,
which still bridge the microseconds between a training step's ops (the step time and a torch
memcpy did not move; ``OMP_WAIT_POLICY=PASSIVE`` made the memcpy ~15% slower).

libgomp reads ``GOMP_SPINCOUNT`` once, when torch loads it, so this must run before torch is
imported. This module imports nothing heavy for that reason.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPINCOUNT = "10000"


def bound_openmp_spin(env: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPINCOUNT` unless it, or ``OMP_WAIT_POLICY``, is already
    set (a user's choice wins). Returns whether this process's OpenMP runtime will see it: not
    once torch is imported, though child processes started later still inherit it."""
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = SPINCOUNT
    return "torch" not in sys.modules
