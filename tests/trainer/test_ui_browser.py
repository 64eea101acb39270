"""A person at the trainer Space's page: Playwright drives Debian's chromium against the real
``python -m trainer_space`` process, which trains against real env and rollout processes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from shared.process import ServerProcess, free_port

pytestmark = pytest.mark.slow
TRAINER_TOKEN = "ui-test-token"


@pytest.fixture
def trainer_page(services, policy_dir: Path, tmp_path: Path):
    port = free_port()
    env = {"DELTASYNC_MODEL": str(policy_dir), "DELTASYNC_STORE": str(services.store),
           "DELTASYNC_REPLICAS": services.rollout.url, "DELTASYNC_ENV_URL": services.env.url,
           "DELTASYNC_TOKEN": services.token, "DELTASYNC_API_KEY": services.api_key,
           "DELTASYNC_TRAINER_TOKEN": TRAINER_TOKEN,
           "DELTASYNC_OUTPUT_DIR": str(tmp_path / "trainer"), "GRADIO_ANALYTICS_ENABLED": "False"}
    with ServerProcess([sys.executable, "-m", "trainer_space", "--host", "127.0.0.1", "--port", str(port)],
                       port=port, log_path=tmp_path / "trainer.log", env=env) as proc:
        yield proc.wait_ready(120)


def test_start_a_run_and_watch_it(trainer_page: ServerProcess, services, chromium: dict):
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(**chromium)
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(trainer_page.url, wait_until="domcontentloaded")
            page.get_by_label("optimizer steps").fill("2")

            page.locator("#start").click()  # no token: refused, nothing starts
            expect(page.locator("#notice")).to_contain_text("refused: wrong or missing trainer token")
            expect(page.locator("#status")).to_contain_text("idle")

            page.get_by_label("trainer token (needed when the Space sets one)").fill(TRAINER_TOKEN)
            page.locator("#start").click()
            expect(page.locator("#notice")).to_contain_text("running")

            # Versions 1 (cold sync) .. 3 land, each checked against the replica's live weights.
            shot = Path(trainer_page.log_path).with_name("trainer-ui.png")
            table = page.locator("#versions")
            try:
                expect(page.locator("#status")).to_contain_text("finished", timeout=600_000)
                expect(table).to_contain_text("exact")
            finally:
                page.screenshot(path=str(shot), full_page=True)
            text = table.inner_text()
            # One verdict per version row (its last cell; an empty "served exactly by" cell leaves no
            # line in the text): versions 1 (the cold sync) .. 3 each
            # checked against the replica's live weights. Version 0, the base checkpoint, is checked
            # only if the UI's timer caught the replica still serving it, so it may say either.
            verdicts = dict(re.findall(r"(?m)^(\d+)\n(?:delta|anchor|delta\+anchor)\n(?:.*\n){4,5}"
                                       r"(exact|MISMATCH|not checked)$", text))
            assert {v: verdicts.get(v) for v in "123"} == dict.fromkeys("123", "exact"), text
            assert verdicts.get("0") in ("exact", "not checked") and len(verdicts) == 4, text
            expect(page.locator("#replicas")).to_contain_text(re.compile(r"ready\s+3\s"))
            # The plots drew their series: Gradio renders each as a Vega SVG whose legend names them
            # (a plot that lost its series shows axes and a colour bar, no names).
            for plot, series in (("#plot-bytes", ("deltasync", "dense bf16", "int32 + bf16")),
                                 ("#plot-train", ("reward", "loss")), ("#plot-times", ("encode", "pause"))):
                expect(page.locator(f"{plot} svg").first).to_be_visible()
                for name in series:
                    expect(page.locator(plot)).to_contain_text(name)
        finally:
            browser.close()
    import httpx

    assert httpx.get(f"{services.rollout.url}/version").json()["version"] == 3
