"""What the reliability tests count: one row per case, tried and came-through (see conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
