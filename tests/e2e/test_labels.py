"""Tree labels never overlap, measured in the browser: the shipped example traces of EAGLE, Medusa, MTPC and
speculative decoding opened in Replay (no model loaded), their main figure drawn by plotly.js, and the drawn SVG
text box of every point label compared with every other (the side-by-side layout at 1400 x 1000 and at 1280 x 720,
and the inspector's full-width tree). A figure that draws too few labels fails too (hiding all of them is no fix).
Also: a click on a token of a multi-token round inspects that token, and brings the inspector on screen; and in
every strategy's example, no figure text is cut by its figure and no title or legend covers other text.
"""

from __future__ import annotations

import re

import pytest

from lab.app import replay
from lab.trace import TokenEmitted, from_json
from tests.appserver import ROOT
from tests.e2e import ui

pytestmark = [pytest.mark.e2e]

APP_ENV = {"DECODING_LAB_NO_WARM": "1"}
EXAMPLES = {"eagle": "EAGLE-2 draft tree", "medusa": "Candidate tree", "mtpc": "Candidate tree", "speculative": "Draft"}
MIN_LABELS = 8


def open_example(page, name: str) -> None:
    ui.tab(page, "Replay")
    for attempt in range(3):  # a pick made while the option list re-renders can be lost: pick again
        ui.choose(page, "replay-example", name)
        try:
            ui.wait_until(lambda: f"strategy {name}," in page.locator("#replay-status").inner_text(), name, 30, page)
            break
        except AssertionError:
            if attempt == 2:
                raise

    def drawn():
        figure = ui.plot_data(page, "replay-main-plot")
        return figure and figure["title"].startswith(EXAMPLES[name]) and len(ui.label_boxes(page, "replay-main-plot"))

    ui.wait_until(drawn, f"{name}'s main figure", 60, page)
    page.wait_for_timeout(500)  # let plotly finish its layout


@pytest.mark.parametrize("viewport", [(1400, 1000), (1280, 720)])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_no_two_tree_labels_overlap(page, screenshot, name: str, viewport: tuple[int, int]):
    page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
    open_example(page, name)
    boxes = ui.label_boxes(page, "replay-main-plot")
    assert len(boxes) >= MIN_LABELS, f"{name}: only {len(boxes)} labels drawn"
    assert not ui.overlaps(boxes), f"{name} at {viewport}: overlapping labels {ui.overlaps(boxes)[:5]}"
    if viewport == (1400, 1000):
        screenshot(page, "replay" if name == "eagle" else f"labels-{name}")


def test_the_inspectors_full_width_tree_has_no_overlapping_labels(page):
    page.set_viewport_size({"width": 1400, "height": 1000})
    open_example(page, "medusa")
    page.locator("#replay-token-view span.dl-token").nth(3).click()
    ui.wait_until(lambda: len(ui.label_boxes(page, "replay-inspect-plot")) >= MIN_LABELS, "the inspector", 60, page)
    page.wait_for_timeout(500)
    boxes = ui.label_boxes(page, "replay-inspect-plot")
    assert not ui.overlaps(boxes), ui.overlaps(boxes)[:5]


def test_clicking_a_token_of_a_round_inspects_that_token_and_scrolls_to_it(page, screenshot):
    """In a multi-token EAGLE round the inspector shows the clicked token's own p (the tooltip's and the Branch
    list's numbers), not the round's first token's; after the click the inspector is on screen."""
    page.set_viewport_size({"width": 1280, "height": 720})
    open_example(page, "eagle")
    trace = from_json((ROOT / "examples" / "traces" / "eagle.json").read_text(encoding="utf-8"))
    tokens = [e for e in trace.events if isinstance(e, TokenEmitted)]
    index = next(i for i in range(1, len(tokens)) if tokens[i].step == tokens[i - 1].step)  # 2nd of a round
    expected, first = tokens[index].top_probs, tokens[index - 1].top_probs
    assert [round(p, 4) for p in expected] != [round(p, 4) for p in first]
    page.evaluate("window.scrollTo(0, 0)")
    page.locator("#replay-token-view span.dl-token").nth(index).click()

    def table_probs():
        rows = ui.table_rows(page, "replay-alternatives")
        return [float(row[2]) for row in rows if len(row) > 2 and re.fullmatch(r"[0-9.e-]+", row[2])]

    wanted = [round(p, 4) for p in expected]
    try:
        ui.wait_until(lambda: table_probs() == wanted, "the clicked token's alternatives", 30, page)
    except AssertionError:
        raise AssertionError(f"the table shows {table_probs()}, the token's p are {wanted}") from None
    plot = "replay-inspect-token-plot"
    title = ui.wait_until(lambda: (ui.plot_data(page, plot) or {}).get("title"), "the token's figure", 30, page)
    assert title.startswith(f"Token {index + 1} ")
    tooltip = page.locator("#replay-token-view span.dl-token").nth(index).get_attribute("title")
    assert f"p={expected[0]:.4f}" in tooltip
    page.wait_for_timeout(800)  # the smooth scroll
    top = ui.box(page, "#replay-inspect-accordion")["y"]
    assert -2 <= top < 720 - 200, f"the inspector is not on screen after the click (top at {top} px)"
    screenshot(page, "inspector-1280x720")


def test_no_figure_text_is_cut_and_no_title_or_legend_covers_text(page):
    """Every strategy's shipped example in Replay at 1400 x 1000: in every drawn figure (main and details), measured
    from the SVG, no text box lies outside its figure and no title, axis title or legend item overlaps other text."""
    page.set_viewport_size({"width": 1400, "height": 1000})
    found, status = [], page.locator("#replay-status")
    for name, _path in replay.example_traces():
        ui.tab(page, "Replay")
        ui.choose(page, "replay-example", name)
        ui.wait_until(lambda name=name: f"strategy {name}," in status.inner_text(), name, 30, page)
        ui.wait_until(lambda: ui.text_boxes(page, "replay-main-plot"), f"{name}'s figure", 60, page)
        page.wait_for_timeout(1500)  # let plotly finish every layout
        found += ui.figure_problems(page, "replay-", name)
    assert not found, "\n".join(found[:30])
