"""Page helpers for the browser tests: every selector the tests use lives here.

Components are found by the stable element ids documented at the top of app.py (`#run-button`, `#main-plot`,
`#replay-token-view`, ...). A plot is read from plotly's own graph div (`gd.data`), so a check sees what the
browser drew, not what the server sent.
"""

from __future__ import annotations

import re
import time

from playwright.sync_api import Locator, Page

RUN_TIMEOUT_S = 240

# Fingerprint of the plotly figure inside the element `#id` (null when no figure is drawn yet).
_PLOT_SIGNATURE_JS = """
(id) => {
  const gd = document.querySelector('#' + id + ' .js-plotly-plot');
  if (!gd || !gd.data) return null;
  const title = gd.layout && gd.layout.title ? (gd.layout.title.text || '') : '';
  return title + '|' + JSON.stringify(gd.data);
}
"""

_RECORD_JS = f"""
(id) => {{
  const signature = {_PLOT_SIGNATURE_JS};
  window.__plotStates = [];
  clearInterval(window.__plotTimer);
  window.__plotTimer = setInterval(() => {{
    const s = signature(id);
    const states = window.__plotStates;
    if (s !== null && (states.length === 0 || states[states.length - 1] !== s)) states.push(s);
  }}, 40);
}}
"""

_PLOT_DATA_JS = """
(id) => {
  const gd = document.querySelector('#' + id + ' .js-plotly-plot');
  if (!gd || !gd.data) return null;
  return {title: gd.layout && gd.layout.title ? (gd.layout.title.text || '') : '',
          traces: gd.data.map(t => ({type: t.type || 'scatter', name: t.name || '',
                                    x: Array.from(t.x || []), y: Array.from(t.y || [])}))};
}
"""


_LABEL_BOXES_JS = """
(id) => {
  const gd = document.querySelector('#' + id + ' .js-plotly-plot');
  if (!gd) return [];
  return Array.from(gd.querySelectorAll('.scatterlayer .textpoint text'))
    .filter((t) => t.textContent.trim() !== '' && t.getAttribute('display') !== 'none')
    .map((t) => {
      const r = t.getBoundingClientRect();
      return {text: t.textContent, l: r.left, t: r.top, r: r.right, b: r.bottom};
    })
    .filter((b) => b.r - b.l > 0 && b.b - b.t > 0);
}
"""


_TEXT_BOXES_JS = """
(id) => {
  const gd = document.querySelector('#' + id + ' .js-plotly-plot');
  if (!gd) return null;
  const svg = gd.querySelector('svg.main-svg');
  if (!svg) return null;
  const frame = svg.getBoundingClientRect();
  const texts = Array.from(gd.querySelectorAll('svg text'))
    .filter((t) => t.textContent.trim() !== '' && t.getAttribute('display') !== 'none'
                   && getComputedStyle(t).visibility !== 'hidden' && Number(getComputedStyle(t).opacity) > 0)
    .map((t) => {
      const r = t.getBoundingClientRect();
      const group = t.closest('g[class]');
      return {text: t.textContent, cls: group ? group.getAttribute('class') : '', l: r.left, t: r.top, r: r.right,
              b: r.bottom};
    })
    .filter((b) => b.r - b.l > 0 && b.b - b.t > 0);
  return {frame: {l: frame.left, t: frame.top, r: frame.right, b: frame.bottom}, texts};
}
"""


def text_boxes(page: Page, elem_id: str) -> dict | None:
    """The drawn frame of the plotly figure in `#elem_id` and the client boxes of every visible text in it (titles,
    ticks, legend, annotations, point labels), or None when no figure is drawn."""
    return page.evaluate(_TEXT_BOXES_JS, elem_id)


def label_boxes(page: Page, elem_id: str) -> list[dict]:
    """The drawn (client) boxes of every non-empty point label of the plotly figure in `#elem_id`."""
    return page.evaluate(_LABEL_BOXES_JS, elem_id)


def box(page: Page, selector: str) -> dict | None:
    """The element's bounding box in the viewport (None when it is not rendered)."""
    return page.locator(selector).first.bounding_box()


def tab(page: Page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()


def choose(page: Page, elem_id: str, option: re.Pattern | str) -> None:
    """Pick an option of the Gradio dropdown `#elem_id`."""
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option).first.click()


def dropdown_value(page: Page, elem_id: str) -> str:
    return page.locator(f"#{elem_id} input").input_value()


def set_number(page: Page, elem_id: str, value: int) -> None:
    """Type a value into the number box of a slider or number field `#elem_id` and commit it."""
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def prompt_box(page: Page) -> Locator:
    return page.locator("#prompt textarea")


def output_text(page: Page, prefix: str = "") -> str:
    return page.locator(f"#{prefix}text textarea").input_value()


def button(page: Page, elem_id: str) -> Locator:
    return page.locator(f"#{elem_id}")


def trace_file_name(page: Page) -> str | None:
    """The name of the trace file offered for download (a new name appears only when a run ends)."""
    link = page.locator('#trace-file a[data-testid="download-link"]')
    return link.first.get_attribute("download") if link.count() else None


def token_spans(page: Page, prefix: str = "") -> Locator:
    return page.locator(f"#{prefix}token-view span.dl-token")


def start_recording_plot(page: Page, elem_id: str) -> None:
    page.evaluate(_RECORD_JS, elem_id)


def recorded_plot_states(page: Page) -> list[str]:
    return page.evaluate("() => { clearInterval(window.__plotTimer); return window.__plotStates || []; }")


def plot_data(page: Page, elem_id: str) -> dict | None:
    return page.evaluate(_PLOT_DATA_JS, elem_id)


def table_rows(page: Page, elem_id: str) -> list[list[str]]:
    """Body cells of the Gradio Dataframe `#elem_id` (a virtual grid of role=row / gridcell divs), as text."""
    return page.evaluate(
        """(id) => Array.from(document.querySelectorAll('#' + id + ' [role=row]'))
               .sort((a, b) => Number(a.getAttribute('aria-rowindex')) - Number(b.getAttribute('aria-rowindex')))
               .map(row => Array.from(row.querySelectorAll('[role=gridcell]')).map(c => c.innerText.trim()))
               .filter(cells => cells.some(c => c !== ''))""",
        elem_id,
    )


def wait_until(predicate, what: str, timeout_s: float = RUN_TIMEOUT_S, page: Page | None = None):
    """Poll `predicate()` until it returns a truthy value; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if page is not None:
            page.wait_for_timeout(150)
        else:
            time.sleep(0.15)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_for_new_trace(page: Page, previous: str | None, timeout_s: float = RUN_TIMEOUT_S) -> str:
    """Wait until the run in flight ends: its final update offers a new trace file."""

    def new_name():
        name = trace_file_name(page)
        return name if name and name != previous else None

    return wait_until(new_name, "the run to finish (a new trace file)", timeout_s, page)


def wait_until_stable(page, read, quiet_ms: int, timeout_s: float = 30):
    """The value of `read()` once it has not changed for `quiet_ms`."""
    value, since, start = read(), time.monotonic(), time.monotonic()
    while time.monotonic() - since < quiet_ms / 1000:
        assert time.monotonic() - start < timeout_s, "the value never settled"
        page.wait_for_timeout(100)
        current = read()
        if current != value:
            value, since = current, time.monotonic()
    return value


def stats_table(page: Page, prefix: str = "") -> dict[str, str]:
    """The stats table as {column name: value} (the markdown table's header cells and its one row)."""
    return page.evaluate(
        """(id) => {
             const heads = Array.from(document.querySelectorAll('#' + id + ' th'));
             const cells = Array.from(document.querySelectorAll('#' + id + ' td'));
             return Object.fromEntries(heads.map((th, i) => [th.innerText.trim(), (cells[i] || {}).innerText || '']));
           }""",
        f"{prefix}stats",
    )


TOLERANCE_PX = 0.5
# text kinds that must never be cut by their figure nor drawn over other text: titles, axis titles, legend items
FRAMED = ("g-gtitle", "g-xtitle", "g-ytitle", "traces", "legend")


def clipped_and_covering(drawn: dict) -> list[str]:
    """Texts cut by the figure's frame (a plotly Table's cells scroll, so they are left out), and titles or legend
    items drawn over any other text, and tick labels of one axis drawn over each other."""
    frame, texts = drawn["frame"], drawn["texts"]
    problems = []
    for t in texts:
        outside = t["l"] < frame["l"] - TOLERANCE_PX or t["r"] > frame["r"] + TOLERANCE_PX
        outside = outside or t["t"] < frame["t"] - TOLERANCE_PX or t["b"] > frame["b"] + TOLERANCE_PX
        if outside and "cell-text" not in t["cls"]:
            problems.append(f"cut: {t['text'][:40]!r} ({t['cls']})")
    framed = [t for t in texts if any(k in t["cls"] for k in FRAMED) and "textpoint" not in t["cls"]]
    for a in framed:
        for b in texts:
            if a is not b and overlaps([a, b]) and not (b in framed and id(b) < id(a)):
                problems.append(f"over: {a['text'][:30]!r} ({a['cls']}) / {b['text'][:30]!r} ({b['cls']})")
    ticks: dict[str, list[dict]] = {}
    for t in texts:
        if "tick" in t["cls"] and "textpoint" not in t["cls"]:
            ticks.setdefault(t["cls"], []).append(t)
    for axis, labels in ticks.items():
        problems += [f"crowded ticks: {a[:20]!r} / {b[:20]!r} ({axis})" for a, b in overlaps(labels)]
    return problems


def overlaps(boxes: list[dict]) -> list[tuple[str, str]]:
    pairs = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if (
                a["l"] < b["r"] - TOLERANCE_PX
                and b["l"] < a["r"] - TOLERANCE_PX
                and a["t"] < b["b"] - TOLERANCE_PX
                and b["t"] < a["b"] - TOLERANCE_PX
            ):
                pairs.append((a["text"], b["text"]))
    return pairs


def figure_ids(prefix: str = "") -> list[str]:
    """The element ids of a run's figures: the main plot and the detail plots."""
    return [f"{prefix}main-plot"] + [f"{prefix}detail-plot-{i}" for i in range(1, 6)]


def figure_problems(page: Page, prefix: str = "", name: str = "") -> list[str]:
    """`clipped_and_covering` over every drawn, visible figure of a run's views."""
    found = []
    for plot in figure_ids(prefix):
        drawn = text_boxes(page, plot)
        if drawn and page.locator(f"#{plot}").is_visible():
            found += [f"{name} {plot}: {p}" for p in clipped_and_covering(drawn)]
    return found
