"""The token view: generated text as coloured spans, plus the alternatives table of one step.

Covers: `token_view_html` (one <span> per TokenEmitted, background = provenance colour, hover title with the
top-k alternatives and their probabilities, `data-step` for click-to-inspect, the selected step outlined, a
legend of the provenance colours present) and `alternatives_table` (rank, token, probability rows of a token).
All token text is HTML-escaped; styles are inline so the fragment renders the same wherever it is embedded.
Not covered: click handling (the app's job) and detail events of other kinds (they are ignored here).
"""

from __future__ import annotations

import html

from lab.trace import Event, TokenEmitted
from visualizers.style import SELECTED_OUTLINE, TEXT_COLOR, display_token, status_color, token_background
from visualizers.token_detail import ranked

PLACEHOLDER = "No tokens yet."
PROB_DIGITS = 4

_CONTAINER_STYLE = (
    f"font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 14px; color: {TEXT_COLOR};"
    " line-height: 1.9; white-space: pre-wrap; word-break: break-word;"
)
_SPAN_STYLE = "background: {bg}; border-radius: 3px; padding: 1px 0; margin: 0 1px 0 0; cursor: pointer;"
_SELECTED_STYLE = f" outline: 2px solid {SELECTED_OUTLINE}; outline-offset: 1px;"
_HIGHLIGHT_STYLE = " text-decoration: underline wavy #7c3aed 2px; text-underline-offset: 3px;"


def _tokens(events: list[Event]) -> list[TokenEmitted]:
    return [e for e in events if isinstance(e, TokenEmitted)]


def _span_text(text: str) -> str:
    """The text shown inside a span: escaped, newlines shown as '⏎' then a real line break, empty as '∅'."""
    if not text:
        return display_token(text)
    return html.escape(text, quote=True).replace("\n", "⏎\n")


def _hover_title(event: TokenEmitted) -> str:
    """The span's hover text: step, provenance, the chosen token and the ranked alternatives (unescaped), from
    `visualizers.token_detail.ranked`, the source the inspector and "Branch from here" read too."""
    lines = [f"step {event.step} · {event.source} · {display_token(event.text, escape=False)!r} (id {event.token_id})"]
    for alt in ranked(event):
        mark = " ◀" if alt.chosen else ""
        lines.append(f"{alt.rank}. {display_token(alt.text, escape=False)!r}  p={alt.p:.{PROB_DIGITS}f}{mark}")
    return "\n".join(lines)


def _token_span(index: int, event: TokenEmitted, selected_step: int | None, highlighted: bool = False) -> str:
    style = _SPAN_STYLE.format(bg=token_background(event.source))
    if selected_step is not None and event.step == selected_step:
        style += _SELECTED_STYLE
    if highlighted:
        style += _HIGHLIGHT_STYLE
    title = html.escape(_hover_title(event), quote=True)
    source = html.escape(event.source, quote=True)
    return (
        f'<span class="dl-token dl-{source}" data-step="{event.step}" data-index="{index}" '
        f'data-source="{source}" title="{title}" style="{style}">{_span_text(event.text)}</span>'
    )


def _legend(sources: list[str]) -> str:
    """A row of swatches, one per provenance present, in order of first appearance."""
    items = []
    for source in dict.fromkeys(sources):
        name = html.escape(source, quote=True)
        swatch = (
            f'<span style="display: inline-block; width: 0.9em; height: 0.9em; border-radius: 2px; '
            f"vertical-align: -0.1em; background: {token_background(source)}; "
            f'border: 1px solid {status_color(source)};"></span>'
        )
        items.append(f'<span class="dl-legend-item" style="margin-right: 1em;">{swatch} {name}</span>')
    style = "font-family: system-ui, sans-serif; font-size: 12px; margin-bottom: 0.4em; color: #475569;"
    return f'<div class="dl-legend" style="{style}">{"".join(items)}</div>'


def token_view_html(
    events: list[Event],
    selected_step: int | None = None,
    highlight_steps: set[int] | frozenset[int] = frozenset(),
    highlight_label: str = "",
    placeholder: str = "",
) -> str:
    """The generated text as one coloured <span> per TokenEmitted (background = `source`), each with a hover
    title listing the top-k alternatives and probabilities and a `data-step` attribute; spans of
    `selected_step` are outlined, spans of `highlight_steps` underlined (e.g. where DoLa differs from greedy,
    explained by `highlight_label` in the legend). Returns a placeholder paragraph when no token was emitted yet
    (`placeholder`, escaped here, says what the run is doing meanwhile; default PLACEHOLDER)."""
    tokens = _tokens(events)
    if not tokens:
        text = html.escape(placeholder or PLACEHOLDER, quote=False)
        return f'<p class="dl-placeholder" style="color: #64748b; font-style: italic;">{text}</p>'
    spans = "".join(_token_span(i, e, selected_step, e.step in highlight_steps) for i, e in enumerate(tokens))
    legend = _legend([e.source for e in tokens])
    if highlight_steps and highlight_label:
        note = f'<span style="{_HIGHLIGHT_STYLE} padding: 0 0.3em;">{html.escape(highlight_label)}</span>'
        legend = legend.replace("</div>", f"{note}</div>", 1)
    return f'<div class="dl-token-view">{legend}<div class="dl-tokens" style="{_CONTAINER_STYLE}">{spans}</div></div>'


def alternatives_table(events: list[Event], index: int) -> list[list]:
    """Rows [rank, token, probability] of the alternatives of the index-th emitted token (its own distribution,
    also in a multi-token round), tokens shown with visible whitespace and unescaped; [] if there is no such token."""
    tokens = _tokens(events)
    if not 0 <= index < len(tokens):
        return []
    return [[a.rank, display_token(a.text, escape=False), round(a.p, PROB_DIGITS)] for a in ranked(tokens[index])]
