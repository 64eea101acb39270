"""The reliability suite's tally: every test counts what it injected and what survived, and the
session ends with one table (and ``$DELTASYNC_RELIABILITY_JSON`` if set).

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

import json
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

KINDS = {"fault": ("faults injected", "survived"), "request": ("requests sent", "ok"),
         "input": ("bad inputs tried", "refused")}


@dataclass
class Row:
    kind: str
    case: str
    tried: int = 0
    good: int = 0


@dataclass
class Tally:
    test: str
    rows: dict[tuple[str, str], Row] = field(default_factory=dict)

    def _add(self, kind: str, case: str, good: bool, n: int = 1) -> None:
        row = self.rows.setdefault((kind, case), Row(kind, case))
        row.tried += n
        row.good += n if good else 0

    def fault(self, case: str, *, survived: bool) -> None:
        self._add("fault", case, survived)

    def request(self, *, ok: bool, case: str = "completions during updates", n: int = 1) -> None:
        self._add("request", case, ok, n)

    def input(self, case: str, *, refused: bool) -> None:
        self._add("input", case, refused)


_TALLIES: list[Tally] = []


@pytest.fixture
def tally(request) -> Iterator[Tally]:
    t = Tally(request.node.nodeid)
    yield t
    # handed over with the test's report: with pytest-xdist the table is printed by another process
    request.node.user_properties.append(("tally", [asdict(r) for r in t.rows.values()]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, rows in report.user_properties if report.when == "teardown" else ():
        if key == "tally":
            _TALLIES.append(Tally(report.nodeid, {(r["kind"], r["case"]): Row(**r) for r in rows}))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    rows = [(t.test, r) for t in _TALLIES for r in t.rows.values()]
    if not rows:
        return
    tw = terminalreporter
    tw.section("reliability: what was injected and what came through")
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    width = max(len(r.case) for _, r in rows)
    for kind, (tried_label, good_label) in KINDS.items():
        mine = [r for _, r in rows if r.kind == kind]
        if not mine:
            continue
        tw.write_line(f"{'':2}{kind + 's':<{width}}  {tried_label:>17}  {good_label:>9}")
        for r in mine:
            tw.write_line(f"{'':2}{r.case:<{width}}  {r.tried:>17}  {r.good:>9}")
            totals[kind][0] += r.tried
            totals[kind][1] += r.good
    tw.write_line("  total: " + ", ".join(f"{KINDS[k][0]} {a} / {KINDS[k][1]} {b}" for k, (a, b) in totals.items()))
    out = os.environ.get("DELTASYNC_RELIABILITY_JSON")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({
            "totals": {k: {"tried": a, "good": b} for k, (a, b) in totals.items()},
            "rows": [{"test": test, **asdict(r)} for test, r in rows]}, indent=2))
