"""The classroom features in a real browser (Debian Chromium), on the embedded model: the token view and the main
figure side by side and both on screen while a run streams (1400 x 1000 and 1280 x 720), presentation mode, the pace
control (a 1 token/s run shows tokens at about that rate while the model itself is faster), left / right keys
stepping through the finished run, and "Branch from here" producing a run that starts with the chosen token.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e import ui

pytestmark = [pytest.mark.e2e, pytest.mark.embedded]

PROMPT = "Name three colours and say one thing about each."
PACED_TOKENS = 6

# (seconds since recording started, tokens shown) every time the count changes
_RECORD_COUNTS_JS = """
() => {
  window.__counts = [];
  const t0 = performance.now();
  clearInterval(window.__countTimer);
  window.__countTimer = setInterval(() => {
    const n = document.querySelectorAll('#token-view span.dl-token').length;
    const c = window.__counts;
    if (c.length === 0 || c[c.length - 1][1] !== n) c.push([(performance.now() - t0) / 1000, n]);
  }, 50);
}
"""


def side_by_side_on_screen(page, height: int) -> str:
    """ "" when the token view and the main plot are side by side and both inside the viewport, else why not."""
    tokens, plot = ui.box(page, "#token-view"), ui.box(page, "#main-plot")
    if not tokens or not plot:
        return "not rendered"
    if plot["x"] < tokens["x"] + tokens["width"] - 5:
        return f"not side by side: tokens {tokens}, plot {plot}"
    for name, b in (("token view", tokens), ("main plot", plot)):
        if b["y"] < 0 or b["y"] + 60 > height:
            return f"{name} is not on screen: {b}"
    return ""


def start_paced_run(page, tokens: int) -> str | None:
    page.get_by_label("1 token/s").check()
    ui.prompt_box(page).fill(PROMPT)
    ui.set_number(page, "max-new-tokens", tokens)
    previous = ui.trace_file_name(page)
    page.evaluate(_RECORD_COUNTS_JS)
    ui.button(page, "run-button").click()
    return previous


@pytest.fixture(scope="module")
def warm(page):
    """A first 2-token run: the model is loaded and plotly.js is on the page before anything is timed."""
    ui.prompt_box(page).fill(PROMPT)
    ui.set_number(page, "max-new-tokens", 2)
    previous = ui.trace_file_name(page)
    ui.button(page, "run-button").click()
    ui.wait_for_new_trace(page, previous)
    ui.wait_until(lambda: ui.plot_data(page, "main-plot"), "the first figure", 120, page)


@pytest.mark.parametrize("viewport", [(1400, 1000), (1280, 720)])
def test_paced_run_side_by_side_at_about_one_token_per_second(page, warm, screenshot, viewport):
    page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
    page.evaluate("window.scrollTo(0, 0)")
    previous = start_paced_run(page, PACED_TOKENS)
    ui.wait_until(lambda: ui.token_spans(page).count() >= 2, "the first paced tokens", 120, page)
    assert side_by_side_on_screen(page, viewport[1]) == ""
    screenshot(page, "run" if viewport == (1400, 1000) else f"run-{viewport[0]}x{viewport[1]}")
    ui.wait_for_new_trace(page, previous)
    counts = page.evaluate("() => { clearInterval(window.__countTimer); return window.__counts; }")
    start = max(i for i, (_, n) in enumerate(counts) if n == min(c for _, c in counts))  # after the old run's view
    shown = [(t, n) for t, n in counts[start:] if n > 0]
    assert shown[-1][1] == PACED_TOKENS, counts
    first = next(t for t, n in shown if n >= 1)
    last = next(t for t, n in shown if n >= PACED_TOKENS)
    rate = (PACED_TOKENS - 1) / (last - first)
    assert 0.55 <= rate <= 1.6, f"paced at {rate:.2f} tokens/s: {counts}"


def test_keyboard_steps_through_the_finished_run(page, warm):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.get_by_label("real time").check()
    ui.prompt_box(page).fill(PROMPT)
    ui.set_number(page, "max-new-tokens", 8)
    previous = ui.trace_file_name(page)
    ui.button(page, "run-button").click()
    ui.wait_for_new_trace(page, previous)
    total = ui.wait_until_stable(page, lambda: ui.token_spans(page).count(), quiet_ms=1000)
    page.locator("#stats").click()  # focus the page, not a text field
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    ui.wait_until(lambda: ui.token_spans(page).count() == total - 2, "two steps back", 30, page)
    stats = page.locator("#stats").inner_text()
    assert f"token {total - 2} of {total} shown" in stats and "running" not in stats, stats
    page.keyboard.press("ArrowRight")
    ui.wait_until(lambda: ui.token_spans(page).count() == total - 1, "one step forward", 30, page)
    page.keyboard.press("ArrowRight")
    ui.wait_until(lambda: ui.token_spans(page).count() == total, "back at the end", 30, page)


_FIGURE_TEXT_PX_JS = """
() => Array.from(document.querySelectorAll('#main-plot .xtick text, #main-plot .ytick text'))
  .map((t) => t.getBoundingClientRect().height).filter((h) => h > 0)
"""


def test_presentation_mode_fills_a_1280x720_screen_with_the_run(page, warm, screenshot):
    """Presentation mode at 1280 x 720: settings, header, prompt, details and the Branch panel hidden; the token view
    and the main figure start near the top and fill the screen; token text large, figure text at least 18 px."""
    page.set_viewport_size({"width": 1280, "height": 720})
    page.evaluate("window.scrollTo(0, 0)")
    ui.button(page, "present-button").click()
    ui.wait_until(lambda: page.evaluate("document.body.classList.contains('dl-present')"), "presentation", 10, page)
    page.evaluate("window.scrollTo(0, 0)")
    page.wait_for_timeout(1500)  # plotly re-lays out the zoomed figure
    for hidden in ("#run-settings", "#detail-plot-1", "#branch-button", "#prompt", "#example-prompts"):
        assert not page.locator(hidden).first.is_visible(), f"{hidden} is visible in presentation mode"
    assert side_by_side_on_screen(page, 720) == ""
    plot = ui.box(page, "#main-plot")
    bottom = plot["y"] + plot["height"]
    assert plot["y"] < 280 and 560 < bottom <= 730, f"the figure does not fill the screen: {plot}"
    size = page.evaluate("parseFloat(getComputedStyle(document.querySelector('#token-view .dl-tokens')).fontSize)")
    assert size >= 28, size
    texts = "Array.from(document.querySelectorAll('#main-plot svg text'))"
    rights = page.evaluate(f"{texts}.map(t => t.getBoundingClientRect().right)")
    assert max(rights) <= plot["x"] + plot["width"] + 1, "the zoomed figure is cut at its right edge"
    heights = page.evaluate(_FIGURE_TEXT_PX_JS)
    assert heights and min(heights) >= 18, f"figure tick text boxes {heights[:6]} px high"
    screenshot(page, "presentation")
    ui.button(page, "present-button").click()
    assert page.locator("#run-settings").is_visible()


def test_the_phone_layout_puts_the_prompt_first_and_lists_the_stats(page, warm, screenshot):
    """390 x 844: the prompt and Run are on the first screen; the stats read as a list (each name beside its value,
    no cell one letter wide)."""
    page.set_viewport_size({"width": 390, "height": 844})
    page.evaluate("document.body.classList.remove('dl-present'); window.scrollTo(0, 0)")
    page.wait_for_timeout(500)
    for selector in ("#prompt textarea", "#run-button"):
        b = ui.box(page, selector)
        assert b and b["y"] + b["height"] < 844, f"{selector} is not on the first screen: {b}"
    cells = page.evaluate(
        """() => Array.from(document.querySelectorAll('#stats th')).map((th, i) => {
             const td = document.querySelectorAll('#stats td')[i];
             const a = th.getBoundingClientRect(), b = td.getBoundingClientRect();
             return {name: th.innerText, ay: a.top, by: b.top, aw: a.width, bw: b.width, bl: b.left, ar: a.right};
           })"""
    )
    assert len(cells) >= 5
    for c in cells:
        assert abs(c["ay"] - c["by"]) < 4 and c["bl"] >= c["ar"] - 1, f"{c['name']} is not beside its value: {c}"
        assert c["aw"] > 40 and c["bw"] > 20, f"a stats cell is squeezed: {c}"
    screenshot(page, "phone-390x844")
    page.set_viewport_size({"width": 1400, "height": 1000})


def test_branch_from_here_starts_with_the_chosen_token(page, warm, screenshot):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.get_by_label("real time").check()
    ui.prompt_box(page).fill(PROMPT)
    ui.set_number(page, "max-new-tokens", 8)
    previous = ui.trace_file_name(page)
    ui.button(page, "run-button").click()
    ui.wait_for_new_trace(page, previous)
    page.locator("#token-view span.dl-token").nth(2).click()
    ui.wait_until(lambda: "Branch at token 3" in page.locator("#branch-where").inner_text(), "branch choices", 30, page)
    label = ui.wait_until(lambda: ui.dropdown_value(page, "branch-choice"), "a preselected alternative", 30, page)
    chosen = re.match(r"\d+\. (.*)  \(p=", label).group(1)
    ui.button(page, "branch-button").click()
    first = page.locator("#branch-tokens span.dl-token").first
    ui.wait_until(lambda: first.count() and first.get_attribute("data-source") == "forced", "the branch", 120, page)
    shown = re.search(r"forced · '(.*)' \(id", first.get_attribute("title")).group(1)
    assert shown == chosen
    ui.wait_until(lambda: "branch at token 3" in page.locator("#run-tree").inner_text(), "the tree of runs", 120, page)
    assert page.locator("#branch-original span.dl-token").count() >= 3
    screenshot(page, "branch")


def test_step_mode_says_what_to_press_and_leaving_it_shows_the_whole_run(page, warm):
    """Step on click: the status names the ▶ button that exists and counts the tokens shown; ▶ releases one; after
    the run, switching to real time shows the whole run; no glyph the page's fonts lack (⏸)."""
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.get_by_label("step on click").check()
    ui.prompt_box(page).fill(PROMPT)
    ui.set_number(page, "max-new-tokens", 6)
    previous = ui.trace_file_name(page)
    ui.button(page, "run-button").click()
    stats = page.locator("#stats")
    ui.wait_until(lambda: "step mode: press ▶" in stats.inner_text(), "the step-mode status", 120, page)
    assert "Step" not in stats.inner_text().replace("step mode", "")  # no button called Step exists
    ui.button(page, "step-next").click()
    ui.wait_until(lambda: ui.token_spans(page).count() == 1, "one released token", 60, page)
    ui.wait_for_new_trace(page, previous)
    ui.button(page, "step-next").click()
    ui.wait_until(lambda: ui.token_spans(page).count() == 2, "the next token of the ended run", 30, page)
    ui.wait_until(lambda: re.search(r"token 2 of \d shown", stats.inner_text()), "the position in the stats", 30, page)
    page.get_by_label("real time").check()
    total = ui.wait_until_stable(page, lambda: ui.token_spans(page).count(), quiet_ms=1000)
    assert total > 2 and "shown" not in stats.inner_text(), stats.inner_text()
    assert "⏸" not in page.content()
