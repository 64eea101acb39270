"""A person's game on /web: Playwright drives Debian's chromium (never a downloaded browser)."""

from __future__ import annotations

from pathlib import Path

from wordle_helpers import answer_for, wrong_guesses

from env_space.wordle import marks_to_str, score_guess

def _row_marks(page, row: int) -> str:
    tiles = page.locator(f'#wordle-board [data-row="{row}"] .wordle-tile')
    return "".join(
        {"G": "G", "Y": "Y", "X": "X", "empty": "."}[tiles.nth(i).get_attribute("data-mark")]
        for i in range(5)
    )


def test_play_one_game_in_the_browser(server, chromium: dict, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    seed = 4242
    target = answer_for(seed)
    opener = wrong_guesses(target, 1)[0]

    expect.set_options(timeout=30_000)  # a loaded 2-core CI box can be slow to round-trip
    with sync_playwright() as p:
        browser = p.chromium.launch(**chromium)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.goto(f"{server.base_url}/web/", wait_until="domcontentloaded")

            page.locator("#seed input").fill(str(seed))
            page.locator("#new-game").click()
            expect(page.locator("#status")).to_contain_text("guess the 5-letter word")

            page.locator("#guess input").fill("qxzvj")  # not a word: penalty, no row used
            page.locator("#submit").click()
            expect(page.locator("#status")).to_contain_text("not in the word list")
            assert _row_marks(page, 0) == "....."

            page.locator("#guess input").fill(opener)
            page.locator("#guess input").press("Enter")
            expected = marks_to_str(score_guess(opener, target))
            expect(page.locator('#wordle-board [data-row="0"] .wordle-tile').first).not_to_have_attribute(
                "data-mark", "empty"
            )
            assert _row_marks(page, 0) == expected
            expect(page.locator("#status")).to_contain_text("You have 5 guesses left")

            page.locator("#guess input").fill(target.upper())
            page.locator("#submit").click()
            expect(page.locator("#status")).to_contain_text("Congratulations")
            assert _row_marks(page, 1) == "GGGGG"
            assert (
                page.locator('#wordle-board [data-row="1"]').inner_text().replace("\n", "").lower() == target
            )
            page.screenshot(path=str(tmp_path / "wordle-web.png"), full_page=True)
        finally:
            browser.close()
    server.assert_alive()
