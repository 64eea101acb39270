"""The reliability suite's tally: every test counts what it injected and what survived, and the
session ends with one table (and ``$DELTASYNC_RELIABILITY_JSON`` if set), printed by
``tests/conftest.py``, which pytest-xdist's controller loads too.

A test asks for the ``tally`` fixture and records, for each thing it did, whether the system
came through it:

    tally.fault("rollout SIGKILL during stage", survived=True)
    tally.request(ok=True)                       # one request sent during load
    tally.input("delta: truncated body", refused=True)

Survived means: a valid, exact version served afterwards and nothing lost; refused means: a clear
error and nothing changed. Counts are recorded as they happen and reported when the test ends,
so a failing test still shows how far it got.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

import pytest

from reliability.tally import Tally


@pytest.fixture
def tally(request) -> Iterator[Tally]:
    t = Tally(request.node.nodeid)
    yield t
    # handed over with the test's report: with pytest-xdist the table is printed by another process
    request.node.user_properties.append(("tally", [asdict(r) for r in t.rows.values()]))
