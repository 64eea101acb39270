"""Fixtures shared by every test folder."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import pytest
from reliability.tally import KINDS, Row, Tally

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3 model (tied embeddings), built once per session."""
    from shared.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def chromium() -> dict:
    """Playwright launch options for Debian's chromium (never a browser Playwright downloads);
    its absence fails the test."""
    assert CHROMIUM.exists(), "needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"
    return {"executable_path": str(CHROMIUM), "args": CHROMIUM_ARGS, "headless": True}


# ---------------------------------------------------------------- the reliability tests' table

_TALLIES: list[Tally] = []


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
