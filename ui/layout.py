"""Page layout shared by the Run and Replay tabs: the token view and the strategy's main figure side by side (they
wrap to one column on narrow screens), detail figures in an accordion under them, presentation mode (large type,
one figure, high contrast: a class on <body>, toggled in the browser), and keyboard stepping (left / right click
the visible tab's step buttons). Gradio UI code only.
"""

from __future__ import annotations

import gradio as gr

MAX_FIGURES = 6  # plot slots: a strategy's main view first, then its detail views
# A click on a token span (data-step) of a token view sends {step, index} with the HTML component's click event.
TOKEN_CLICK_JS = """
element.addEventListener('click', (event) => {
  const span = event.target.closest('[data-step]');
  if (!span || !element.contains(span)) return;
  trigger('click', {step: Number(span.dataset.step), index: Number(span.dataset.index)});
});
"""
# Left / right arrows: the first visible pair of step buttons (the Run or Replay tab), unless typing in a field.
KEYS_JS = """
() => {
  if (window.__dlKeys) return;
  window.__dlKeys = true;
  document.addEventListener('keydown', (event) => {
    if (event.key !== 'ArrowLeft' && event.key !== 'ArrowRight') return;
    const target = event.target;
    if (target && (target.isContentEditable || ['INPUT', 'TEXTAREA', 'SELECT'].includes(target.tagName))) return;
    const which = event.key === 'ArrowLeft' ? 'back' : 'next';
    const button = Array.from(document.querySelectorAll('.dl-step-' + which)).find((b) => b.offsetParent !== null);
    if (button) { event.preventDefault(); button.click(); }
  });
}
"""
# A number typed into a bounded field (a slider's box, a Number with a minimum) outside its range is clamped to the
# nearest bound at once, and a note under the field says so, naming it; Gradio would otherwise keep showing the typed
# value while the slider (and the run) silently use the bound.
CLAMP_JS = """
() => {
  if (window.__dlClamp) return;
  window.__dlClamp = true;
  document.addEventListener('change', (event) => {
    const box = event.target;
    if (!box || box.tagName !== 'INPUT' || box.type !== 'number' || box.value === '') return;
    const block = box.closest('.block');
    const value = Number(box.value);
    const low = box.min === '' ? -Infinity : Number(box.min);
    const high = box.max === '' ? Infinity : Number(box.max);
    let note = block ? block.querySelector(':scope .dl-clamped') : null;
    if (!(value < low || value > high)) { if (note) note.remove(); return; }
    const bound = value < low ? low : high;
    const label = block && block.querySelector('[data-testid="block-info"]');
    const name = label ? label.textContent.trim() : 'this field';
    box.value = String(bound);
    box.dispatchEvent(new Event('input', {bubbles: true}));
    if (block && !note) {
      note = document.createElement('div');
      note.className = 'dl-clamped';
      note.setAttribute('role', 'status');
      block.appendChild(note);
    }
    if (note) note.textContent = `${name}: ${value} is ${value < low ? 'below the minimum' : 'above the maximum'} ` +
      `${bound}; set to ${bound}.`;
  }, true);
}
"""
PAGE_JS = f"() => {{ ({KEYS_JS.strip()})(); ({CLAMP_JS.strip()})(); }}"
# Toggle presentation mode, then tell plotly the figures' sizes changed (the zoomed main figure lays out anew).
PRESENT_JS = """
() => {
  document.body.classList.toggle('dl-present');
  for (const wait of [50, 400]) setTimeout(() => window.dispatchEvent(new Event('resize')), wait);
}
"""
CSS = """
.dl-token:hover { filter: brightness(0.92); }
.dl-views > .column { min-width: 0; }
/* stats headers break between words only ("forwards/toke n" was unreadable) */
.dl-stats th, .dl-stats td { overflow-wrap: normal !important; word-break: normal !important; }
body.dl-present .dl-hide-present, body.dl-present #run-settings, body.dl-present #dl-header,
body.dl-present .dl-details, body.dl-present #prompt, body.dl-present #chat,
body.dl-present .tab-wrapper, body.dl-present [role="tablist"] { display: none !important; }
body.dl-present .gradio-container { max-width: 100% !important; background: #ffffff !important; }
body.dl-present .dl-tokens { font-size: 30px !important; line-height: 1.55 !important; color: #000000 !important; }
body.dl-present .dl-token { border: 1px solid #000000; }
body.dl-present .dl-legend { font-size: 18px !important; color: #000000 !important; }
body.dl-present .dl-stats, body.dl-present .dl-stats * { font-size: 18px !important; color: #000000 !important; }
body.dl-present .dl-stats td, body.dl-present .dl-stats th { padding: 2px 8px !important; }
body.dl-present .dl-stats p:has(> em:only-child) { display: none !important; } /* the model line */
body.dl-present .dl-views { flex-wrap: nowrap !important; }
/* figures drawn at 1.5x: plotly lays them out in the narrower unzoomed width, so 12 px text shows at 18 px */
body.dl-present [id$="main-plot"] { zoom: 1.5; }
body.dl-present [id$="main-plot"] [data-testid="block-label"] { display: none !important; }
/* the controls as one small bar: Run and Stop side by side, the pace without its label, short buttons */
body.dl-present #run-stop { flex-direction: row !important; flex-wrap: nowrap !important; }
body.dl-present #run-controls { align-items: center !important; }
body.dl-present #pace [data-testid="block-info"] { display: none !important; }
body.dl-present #run-stop button, body.dl-present #run-controls button {
  min-height: 0 !important; height: 40px !important; padding: 4px 12px !important;
}
body.dl-present #present-button { line-height: 1.1 !important; font-size: 13px !important; }
@media (max-width: 700px) { .dl-views { flex-direction: column !important; } }
"""
MAX_STAT_ROWS = 16
# Phone (narrow) layout: the Run tab's prompt, Run and views first and its settings after them; the one-row stats
# table shown as a two-column list (each header beside its value, by explicit grid placement).
PHONE_CSS = (
    "@media (max-width: 700px) {\n"
    "  #run-settings { order: 2; }\n"
    "  .dl-stats table { display: grid !important; grid-template-columns: max-content 1fr; overflow: visible; }\n"
    "  .dl-stats thead, .dl-stats tbody, .dl-stats tr { display: contents; }\n"
    "  .dl-stats th, .dl-stats td { white-space: normal; text-align: left; }\n"
    + "".join(
        f"  .dl-stats th:nth-child({k}) {{ grid-row: {k}; grid-column: 1; }}"
        f" .dl-stats td:nth-child({k}) {{ grid-row: {k}; grid-column: 2; }}\n"
        for k in range(1, MAX_STAT_ROWS + 1)
    )
    + "}\n"
)
CSS += PHONE_CSS


def build_views(prefix: str, details_open: bool = True) -> dict:
    """The views of one run: stats, then the clickable token view beside the main plot, then the detail plots and
    the text in an accordion."""
    views = {"stats": gr.Markdown(elem_id=f"{prefix}stats", elem_classes=["dl-stats"])}
    with gr.Row(equal_height=False, elem_id=f"{prefix}views", elem_classes=["dl-views"]):
        with gr.Column(scale=1, min_width=280):
            views["tokens"] = gr.HTML(label="Tokens", elem_id=f"{prefix}token-view", js_on_load=TOKEN_CLICK_JS)
        with gr.Column(scale=1, min_width=280):
            views["main"] = gr.Plot(label="Internals", show_label=False, elem_id=f"{prefix}main-plot")
    with gr.Accordion("Details: more views of this run", open=details_open, elem_classes=["dl-details"]):
        with gr.Row(equal_height=False):
            views["details"] = [
                # no block label: each figure's own title says what it shows (a label also covered the title)
                gr.Plot(
                    visible=False, label="Details", show_label=False, elem_id=f"{prefix}detail-plot-{i}", min_width=420
                )
                for i in range(1, MAX_FIGURES)
            ]
        views["text"] = gr.Textbox(label="Text", lines=3, interactive=False, elem_id=f"{prefix}text")
    return views


def view_list(views: dict) -> list:
    """Components in `view_updates` order."""
    return [views["tokens"], views["main"], views["stats"], views["text"], *views["details"]]


def step_buttons(prefix: str) -> tuple[gr.Button, gr.Button]:
    """◀ / ▶ buttons (also the targets of the left / right keys)."""
    back = gr.Button("◀", elem_id=f"{prefix}step-back", elem_classes=["dl-step-back"], scale=0, min_width=50)
    nxt = gr.Button("▶", elem_id=f"{prefix}step-next", elem_classes=["dl-step-next"], scale=0, min_width=50)
    return back, nxt
